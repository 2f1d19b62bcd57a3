"""A slow, obviously correct prefix-cache simulator to hold the fast one to: it keeps every cached
unit (a whole prefix, as a tuple) with its last use and evicts the least recently used one."""

from __future__ import annotations


def reference_reuse(requests: list[tuple[list[int], list[int]]], unit: int, capacity_tokens: int | None) -> list[int]:
    """Reusable prompt tokens per (prompt, cached sequence) request, replayed in order."""
    cache: dict[tuple[int, ...], tuple[int, int]] = {}  # prefix -> (last request, -depth)
    reuse = []
    for stamp, (prompt, sequence) in enumerate(requests):
        matched = 0
        while (matched + 1) * unit <= len(sequence) and tuple(sequence[: (matched + 1) * unit]) in cache:
            matched += 1
        reuse.append(min(matched, (len(prompt) - 1) // unit) * unit)
        for k in range(len(sequence) // unit):
            cache[tuple(sequence[: (k + 1) * unit])] = (stamp, -k)
        if capacity_tokens is not None:
            while len(cache) > capacity_tokens // unit:
                del cache[min(cache, key=cache.get)]
    return reuse
