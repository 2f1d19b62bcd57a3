"""The pool of KV blocks with per-block reference counts. Pure Python.

Invariant: a block is in exactly one of three states: free (in the free list, ref 0, not cached),
owned (ref > 0: held by that many requests), or cached-idle (ref 0, held only by the prefix
cache, evictable). Block 0 is the null block and is never handed out.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"the KV pool needs at least 2 blocks, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(1, num_blocks))
        self._is_free = [False] + [True] * (num_blocks - 1)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def capacity(self) -> int:
        return self.num_blocks - 1

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise MemoryError(f"asked for {count} blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(count)]
        for block in blocks:
            self._is_free[block] = False
            self.ref_counts[block] = 1
        return blocks

    def take_ref(self, blocks: Sequence[int]) -> None:
        for block in blocks:
            self.ref_counts[block] += 1

    def drop_ref(self, blocks: Sequence[int], is_cached: Callable[[int], bool]) -> None:
        """Release one reference to each block; blocks nobody holds and the cache does not keep
        return to the free list."""
        for block in blocks:
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0 and not is_cached(block):
                self.release(block)

    def release(self, block: int) -> None:
        assert self.ref_counts[block] == 0 and not self._is_free[block], block
        self._is_free[block] = True
        self._free.append(block)

    def is_free(self, block: int) -> bool:
        return self._is_free[block]

    def check_integrity(self, owners: dict[int, int], cached: set[int]) -> None:
        """`owners`: block -> number of requests holding it; `cached`: blocks the prefix cache keeps."""
        free = set(self._free)  # a set: membership in the deque would make this check quadratic
        assert len(free) == len(self._free), "a block is in the free list twice"
        assert 0 not in free and self.ref_counts[0] == 0, "the null block was handed out"
        for block in range(1, self.num_blocks):
            refs = self.ref_counts[block]
            assert refs == owners.get(block, 0), f"block {block}: ref {refs} != owners {owners.get(block, 0)}"
            assert self._is_free[block] == (block in free), f"block {block}: free flag out of sync"
            if self._is_free[block]:
                assert refs == 0 and block not in cached, f"block {block} is free but held"
            else:
                assert refs > 0 or block in cached, f"block {block} leaked: not free, not owned, not cached"
