"""Gives requests KV blocks: reused prefixes by reference, new blocks from the pool, eviction of
idle cached blocks when the pool runs short. Pure Python.

The manager allocates and returns block ids; the scheduler writes them into the request. A
request's `block_ids` cover its first `num_computed_tokens` (+ this step's) tokens in order. Its
full, computed blocks enter the prefix cache as soon as they exist, so concurrent requests of one
group share a prefix while the first is still running.
"""

from __future__ import annotations

from typing import Any

from pagoda.core.block_pool import BlockPool
from pagoda.core.prefix_cache import NoPrefixCache, PrefixCache, PrefixMatch
from pagoda.core.radix_cache import RadixCache
from pagoda.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.cache: PrefixCache[Any] = RadixCache(block_size) if enable_prefix_caching else NoPrefixCache(block_size)
        self._locked: dict[str, Any] = {}  # request id -> the deepest cache node it locks
        self._num_inserted: dict[str, int] = {}  # request id -> leading blocks already offered to the cache

    # ---- capacity ------------------------------------------------------------------------
    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def num_available(self) -> int:
        """Blocks that can be handed out now: free ones plus idle cached ones."""
        return self.pool.num_free + self.cache.num_evictable_blocks

    @property
    def usage(self) -> float:
        """Fraction of the pool held by requests (idle cached blocks count as free)."""
        return 1.0 - self.num_available / self.pool.capacity

    # ---- admission -----------------------------------------------------------------------
    def find_prefix(self, request: Request) -> PrefixMatch[Any]:
        """The cached prefix of a request's tokens in its cache namespace, in whole blocks, leaving at
        least one token to compute (its logits are needed). A pure query."""
        return self.cache.find(request.token_ids, (request.num_tokens - 1) // self.block_size, request.cache_namespace)

    def admit(self, request_id: str, prefix: PrefixMatch[Any], num_tokens: int) -> list[int] | None:
        """Blocks for a waiting request's first `num_tokens` tokens: the reused `prefix` (a cache
        hit or a sibling's blocks), then new ones. None, with nothing taken, when the pool cannot
        hold them."""
        need = self.blocks_for(num_tokens) - len(prefix.blocks)
        node = self.cache.touch(prefix) if prefix.node is not None else None
        if node is not None:
            self.cache.lock(node)  # first, so that eviction for `need` cannot take the hit itself
        if need > self.num_available:
            if node is not None:
                self.cache.unlock(node)
            return None
        if node is not None:
            self._locked[request_id] = node
        self.pool.take_ref(prefix.blocks)
        self._num_inserted[request_id] = len(prefix.blocks)
        return list(prefix.blocks) + self._allocate(need)

    def grow(self, request: Request, num_new_tokens: int) -> list[int] | None:
        """The blocks a running request needs for `num_new_tokens` more tokens (often none); None
        if the pool is short."""
        need = self.blocks_for(request.num_computed_tokens + num_new_tokens) - len(request.block_ids)
        if need > self.num_available:
            return None
        return self._allocate(need)

    # ---- after a step --------------------------------------------------------------------
    def cache_blocks(self, request: Request) -> list[int]:
        """Offer the request's newly full, computed blocks to the prefix cache. Returns the blocks
        the request holds from now on: where the cache already had some of them (another request
        computed the same tokens in the same step), its copies, ours freed; one copy of each prefix
        stays in the pool. Safe because block tables are rebuilt every step."""
        full = request.num_computed_tokens // self.block_size
        start = self._num_inserted.get(request.request_id, 0)
        if full <= start:
            return request.block_ids
        node = self.cache.insert(
            request.token_ids[: full * self.block_size], request.block_ids[:full], request.cache_namespace
        )
        self.cache.lock(node)
        old = self._locked.pop(request.request_id, None)
        if old is not None:
            self.cache.unlock(old)
        self._locked[request.request_id] = node
        self._num_inserted[request.request_id] = full
        blocks = list(request.block_ids)
        for i, cached in enumerate(self.cache.path_blocks(node)[start:], start):
            if cached != blocks[i]:
                self.pool.take_ref([cached])
                self.pool.drop_ref([blocks[i]], self.cache.is_cached)
                blocks[i] = cached
        return blocks

    def free(self, request: Request) -> None:
        """Release everything the request holds; what it computed stays cached (if caching is on)."""
        blocks = self.cache_blocks(request)
        node = self._locked.pop(request.request_id, None)
        if node is not None:
            self.cache.unlock(node)
        self._num_inserted.pop(request.request_id, None)
        self.pool.drop_ref(blocks, self.cache.is_cached)

    def reset_prefix_cache(self) -> bool:
        """Drop all cached blocks; refused (False) while any request holds cached blocks."""
        if self._locked:
            return False
        for block in self.cache.reset():
            self.pool.release(block)
        return True

    # ---- integrity -----------------------------------------------------------------------
    def check_integrity(self, requests: list[Request]) -> None:
        owners: dict[int, int] = {}
        for request in requests:
            assert len(set(request.block_ids)) == len(request.block_ids), "a request holds a block twice"
            assert len(request.block_ids) >= self.blocks_for(request.num_computed_tokens), (
                "computed tokens without blocks"
            )
            for block in request.block_ids:
                owners[block] = owners.get(block, 0) + 1
        self.pool.check_integrity(owners, self.cache.cached_blocks())
        assert set(self._locked) <= {r.request_id for r in requests}, "a lock outlived its request"
        self.cache.check_integrity(list(self._locked.values()))

    # ---- helpers -------------------------------------------------------------------------
    def _allocate(self, count: int) -> list[int]:
        if count <= 0:
            return []
        short = count - self.pool.num_free
        if short > 0:
            for block in self.cache.evict(short, lambda b: self.pool.ref_counts[b] == 0):
                self.pool.release(block)
        return self.pool.allocate(count)
