"""Gives requests KV blocks: prefix-cache hits by reference, new blocks from the pool, eviction
of idle cached blocks when the pool runs short. Pure Python.

A request's `block_ids` cover its first `num_computed_tokens` (+ this step's) tokens in order.
Its full, computed blocks enter the prefix cache as soon as they exist, so concurrent requests of
one group share a prefix while the first is still running.
"""

from __future__ import annotations

from pagoda.core.block_pool import BlockPool
from pagoda.core.radix_cache import RadixCache, RadixNode
from pagoda.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.cache = RadixCache(block_size) if enable_prefix_caching else None
        self._locked: dict[str, RadixNode] = {}  # request id -> deepest cached node it locks
        self._num_inserted: dict[str, int] = {}  # request id -> leading blocks already offered to the cache
        self.prefix_queries = 0  # prompt tokens looked up (for metrics)
        self.prefix_hits = 0  # of which found cached

    # ---- capacity ------------------------------------------------------------------------
    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def num_available(self) -> int:
        """Blocks that can be handed out now: free ones plus idle cached ones."""
        return self.pool.num_free + (self.cache.num_evictable_blocks if self.cache else 0)

    @property
    def usage(self) -> float:
        """Fraction of the pool held by requests (idle cached blocks count as free)."""
        return 1.0 - self.num_available / self.pool.capacity

    # ---- admission -----------------------------------------------------------------------
    def lookup(self, request: Request) -> int:
        """Tokens of `request` the prefix cache holds (whole blocks; at least one token stays to compute)."""
        if self.cache is None:
            return 0
        blocks, _ = self.cache.match(request.token_ids, self._max_hit_blocks(request))
        return len(blocks) * self.block_size

    def admit(self, request: Request, token_budget: int) -> int | None:
        """Start a waiting request: take its cached prefix (or an n>1 sibling's prompt blocks) and
        blocks for up to `token_budget` more tokens. Returns the number of new tokens scheduled, or
        None, with nothing taken, when the pool cannot hold them."""
        hit_blocks, node = self._find_shared_prefix(request)
        hit_tokens = len(hit_blocks) * self.block_size
        num_new = min(request.num_tokens - hit_tokens, token_budget)
        need = self.blocks_for(hit_tokens + num_new) - len(hit_blocks)
        if node is not None:
            self.cache.lock(node)  # first, so that eviction for `need` cannot take the hit itself
        if need > self.num_available:
            if node is not None:
                self.cache.unlock(node)
            return None
        if node is not None:
            self._locked[request.request_id] = node
        self.pool.take_ref(hit_blocks)
        request.block_ids = list(hit_blocks)
        request.num_computed_tokens = hit_tokens
        self._num_inserted[request.request_id] = len(hit_blocks)
        self._allocate(request, need)
        if request.first_scheduled_time is None:
            request.num_cached_tokens = hit_tokens
            self.prefix_queries += request.num_prompt_tokens
            self.prefix_hits += hit_tokens
        return num_new

    def grow(self, request: Request, num_new_tokens: int) -> bool:
        """Make room for `num_new_tokens` more tokens of a running request; False if the pool is short."""
        need = self.blocks_for(request.num_computed_tokens + num_new_tokens) - len(request.block_ids)
        if need <= 0:
            return True
        if need > self.num_available:
            return False
        self._allocate(request, need)
        return True

    # ---- after a step --------------------------------------------------------------------
    def cache_computed_blocks(self, request: Request) -> None:
        """Offer the request's newly full, computed blocks to the prefix cache."""
        if self.cache is None:
            return
        full = request.num_computed_tokens // self.block_size
        if full <= self._num_inserted.get(request.request_id, 0):
            return
        node = self.cache.insert(request.token_ids[: full * self.block_size], request.block_ids[:full])
        self.cache.lock(node)
        old = self._locked.pop(request.request_id, None)
        if old is not None:
            self.cache.unlock(old)
        self._locked[request.request_id] = node
        self._adopt_cached_copies(request, self.cache.path_blocks(node), self._num_inserted.get(request.request_id, 0))
        self._num_inserted[request.request_id] = full

    def _adopt_cached_copies(self, request: Request, cached: list[int], start: int) -> None:
        """`cached`: the tree's blocks for the request's inserted path. Where the tree already held
        some of them (another request computed the same tokens in the same step), use its copies
        and free ours: one copy of each prefix in the pool. Safe because block tables are rebuilt
        every step."""
        for i in range(start, len(cached)):
            mine = request.block_ids[i]
            if cached[i] != mine:
                self.pool.take_ref([cached[i]])
                request.block_ids[i] = cached[i]
                self.pool.drop_ref([mine], self._is_cached)

    def free(self, request: Request) -> None:
        """Release everything the request holds; what it computed stays cached (if caching is on)."""
        self.cache_computed_blocks(request)
        node = self._locked.pop(request.request_id, None)
        if node is not None:
            self.cache.unlock(node)
        self._num_inserted.pop(request.request_id, None)
        self.pool.drop_ref(request.block_ids, self._is_cached)
        request.block_ids = []

    def reset_prefix_cache(self) -> bool:
        """Drop all cached blocks; refused (False) while any request holds cached blocks."""
        if self.cache is None:
            return True
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
        cached = set(self.cache._block_node) if self.cache else set()
        self.pool.check_integrity(owners, cached)
        if self.cache is not None:
            assert set(self._locked) <= {r.request_id for r in requests}, "a lock outlived its request"
            self.cache.check_integrity(list(self._locked.values()))

    # ---- helpers -------------------------------------------------------------------------
    def _max_hit_blocks(self, request: Request) -> int:
        return (request.num_tokens - 1) // self.block_size

    def _find_shared_prefix(self, request: Request) -> tuple[list[int], RadixNode | None]:
        if request.sampling_params.prompt_logprobs is not None:
            return [], None  # every prompt position must be computed to score it
        if self.cache is not None:
            blocks, node = self.cache.match(request.token_ids, self._max_hit_blocks(request))
            return blocks, node if blocks else None
        parent = request.parent
        if parent is not None and parent.block_ids and request.num_preemptions == 0:
            shareable = min(parent.num_computed_tokens, request.num_prompt_tokens - 1) // self.block_size
            return parent.block_ids[:shareable], None
        return [], None

    def _allocate(self, request: Request, count: int) -> None:
        if count <= 0:
            return
        short = count - self.pool.num_free
        if short > 0 and self.cache is not None:
            for block in self.cache.evict(short, lambda b: self.pool.ref_counts[b] == 0):
                self.pool.release(block)
        request.block_ids += self.pool.allocate(count)

    def _is_cached(self, block: int) -> bool:
        return self.cache is not None and self.cache.is_cached(block)
