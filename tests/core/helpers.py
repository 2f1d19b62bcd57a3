"""Helpers shared by the radix cache's tests."""

from __future__ import annotations

from pagoda.core.radix_cache import RadixCache, RadixNode


def take(
    cache: RadixCache, token_ids: list[int], max_blocks: int, salt: str | None = None
) -> tuple[list[int], RadixNode]:
    """Find the longest prefix cached under `salt` and take it, as the KV manager does when it
    admits a request: (its blocks, the node to lock; the root for a miss)."""
    hit = cache.find(token_ids, max_blocks, salt)
    return list(hit.blocks), cache.touch(hit) if hit.blocks else cache.root
