"""The radix cache against a flat model: a dict from each cached block's salt and whole token
prefix to the block. Random inserts, matches, locks, unlocks, evictions and resets, under a few
salts; after every operation the tree must agree with the model and pass its own integrity check."""

from __future__ import annotations

import itertools

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagoda.core.radix_cache import RadixCache, RadixNode

from .helpers import take

LABELS = st.lists(st.integers(0, 3), min_size=0, max_size=6)  # few labels: many shared prefixes
SALTS = st.sampled_from([None, None, "a", "b"])  # namespaces: the same tokens under each


class RadixCacheMachine(RuleBasedStateMachine):
    @initialize(block_size=st.sampled_from([1, 2, 4, 16]))
    def setup(self, block_size: int) -> None:
        self.bs = block_size
        self.cache = RadixCache(block_size)
        # (salt, *token prefix ending a block) -> its block
        self.model: dict[tuple, int] = {}
        self.locks: list[tuple[RadixNode, tuple]] = []  # locked node, its (salt, *token prefix)
        self.next_block = itertools.count(1)

    def tokens(self, labels: list[int]) -> list[int]:
        return [10 * label + i for label in labels for i in range(self.bs)]

    def locked_prefixes(self) -> set[tuple]:
        return {key[: 1 + (i + 1) * self.bs] for _, key in self.locks for i in range((len(key) - 1) // self.bs)}

    def expected_match(self, salt: str | None, tokens: list[int], max_blocks: int) -> list[int]:
        blocks = []
        for i in range(min(max_blocks, len(tokens) // self.bs)):
            block = self.model.get((salt, *tokens[: (i + 1) * self.bs]))
            if block is None:
                break
            blocks.append(block)
        return blocks

    @rule(labels=LABELS, salt=SALTS, lock=st.booleans())
    def insert(self, labels: list[int], salt: str | None, lock: bool) -> None:
        tokens = self.tokens(labels)
        blocks = [next(self.next_block) for _ in labels]
        node = self.cache.insert(tokens, blocks, salt)
        for i, block in enumerate(blocks):
            self.model.setdefault((salt, *tokens[: (i + 1) * self.bs]), block)
        assert self.expected_match(salt, tokens, len(labels)) == [
            self.model[(salt, *tokens[: (i + 1) * self.bs])] for i in range(len(labels))
        ]
        assert len(node.key) == len(node.blocks) * self.bs
        if labels:
            assert node.blocks[-1] == self.model[(salt, *tokens)] and node.salt == salt
        if lock:
            self.cache.lock(node)
            self.locks.append((node, (salt, *tokens)))

    @rule(labels=LABELS, salt=SALTS, extra=st.integers(0, 15), max_blocks=st.integers(0, 7), lock=st.booleans())
    def match(self, labels: list[int], salt: str | None, extra: int, max_blocks: int, lock: bool) -> None:
        tokens = self.tokens(labels) + [99] * (extra % self.bs)  # maybe a partial last block
        blocks, node = take(self.cache, tokens, max_blocks, salt)
        assert blocks == self.expected_match(salt, tokens, max_blocks)
        assert (node is self.cache.root) == (not blocks)
        if blocks:
            assert node.blocks[-1] == blocks[-1]
        if lock:
            self.cache.lock(node)
            self.locks.append((node, (salt, *tokens[: len(blocks) * self.bs])))

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data) -> None:
        node, _ = self.locks.pop(data.draw(st.integers(0, len(self.locks) - 1)))
        self.cache.unlock(node)

    @rule(num_blocks=st.integers(0, 8))
    def evict(self, num_blocks: int) -> None:
        locked = self.locked_prefixes()
        evictable = [key for key in self.model if key not in locked]
        removed = self.cache.evict(num_blocks, lambda block: True)
        assert len(removed) == min(num_blocks, len(evictable))
        assert len(set(removed)) == len(removed)
        by_block = {block: key for key, block in self.model.items()}
        for block in removed:
            key = by_block[block]
            assert key not in locked, "evicted a locked block"
            del self.model[key]
        for key in self.model:  # what stays is still a whole path from the root
            assert all(key[: 1 + (i + 1) * self.bs] in self.model for i in range((len(key) - 1) // self.bs))

    @rule()
    def reset(self) -> None:
        if self.locks:
            try:
                self.cache.reset()
            except RuntimeError:
                return
            raise AssertionError("reset while locked")
        assert sorted(self.cache.reset()) == sorted(self.model.values())
        self.model.clear()

    @invariant()
    def agrees_with_the_model(self) -> None:
        if not hasattr(self, "cache"):
            return
        self.cache.check_integrity([node for node, _ in self.locks])
        assert self.cache.num_cached_blocks == len(self.model)
        assert all(self.cache.is_cached(block) for block in self.model.values())
        locked = self.locked_prefixes()
        assert self.cache.num_evictable_blocks == sum(1 for key in self.model if key not in locked)


RadixCacheMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
test_radix_cache_agrees_with_a_flat_model = RadixCacheMachine.TestCase
