"""A page-granular radix tree over token ids whose nodes own KV blocks (SGLang's RadixAttention
on paged blocks). Pure Python.

Each node's key is a run of whole blocks: len(key) == len(blocks) * block_size. Children are keyed
by their salt and the tokens of their first block, so siblings never share a first block.

A salt (a request's cache namespace: its `cache_salt`, vLLM's, and its LoRA adapter) names a
namespace: a path is found only by requests with the salt it was inserted with, so tenants that
salt their requests share no KV (vLLM's rule: the salt enters the first block's hash), nor do
requests of different adapters. A node's descendants carry its salt; None is the unsalted one.

Invariants:
- lock_ref of a node == the number of requests whose locked path (root .. their deepest node)
  passes through it; a locked node's ancestors are therefore locked too.
- Only nodes with lock_ref == 0 hold evictable blocks; `num_evictable_blocks` sums them.
- Eviction trims unlocked leaves from their tail, least recently used first.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Hashable, Iterator, Sequence

from pagoda.core.prefix_cache import PrefixMatch

ChildKey = tuple[Hashable, tuple[int, ...]]  # a child's salt and the tokens of its first block


class RadixNode:
    __slots__ = ("key", "blocks", "salt", "children", "parent", "lock_ref", "last_access")

    def __init__(self, key: tuple[int, ...], blocks: list[int], salt: Hashable, parent: RadixNode | None) -> None:
        self.key = key
        self.blocks = blocks
        self.salt = salt
        self.children: dict[ChildKey, RadixNode] = {}
        self.parent = parent
        self.lock_ref = 0
        self.last_access = 0


class RadixCache:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._clock = itertools.count(1)
        self.root = RadixNode((), [], None, None)
        self.root.lock_ref = 1  # the root is never evicted
        self._block_node: dict[int, RadixNode] = {}
        self.num_evictable_blocks = 0

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_cached_blocks(self) -> int:
        return len(self._block_node)

    def is_cached(self, block: int) -> bool:
        return block in self._block_node

    def cached_blocks(self) -> set[int]:
        return set(self._block_node)

    def find(self, token_ids: Sequence[int], max_blocks: int, salt: Hashable = None) -> PrefixMatch[RadixNode]:
        """The longest prefix of `token_ids` cached under `salt`, at most `max_blocks` blocks. A pure
        query: the tree is neither split nor stamped (a policy may peek at many waiting requests)."""
        node, blocks, in_node = self.root, list[int](), 0
        while len(blocks) < max_blocks:
            child = node.children.get(self._block_key(salt, token_ids, len(blocks)))
            if child is None:
                break
            in_node = self._matched_blocks(child, token_ids, len(blocks), max_blocks - len(blocks))
            blocks += child.blocks[:in_node]
            node = child
            if in_node < len(child.blocks):
                break
        return PrefixMatch(tuple(blocks), node if blocks else None, in_node)

    def touch(self, match: PrefixMatch[RadixNode]) -> RadixNode:
        """Take a hit found by `find` (the tree unchanged since): split its last node so that the
        hit ends at a node boundary, and stamp its path as the most recently used. Returns the
        deepest node of the hit, for the caller to lock."""
        node = match.node
        assert node is not None, "touching a miss"
        if match.num_node_blocks < len(node.blocks):
            node = self._split(node, match.num_node_blocks)
        stamp = next(self._clock)
        for upper in _path_up(node):
            upper.last_access = stamp
        return node

    def path_blocks(self, node: RadixNode) -> list[int]:
        """The tree's blocks from the root down to `node`, in token order."""
        parts = [upper.blocks for upper in _path_up(node)]
        return [block for part in reversed(parts) for block in part]

    # ---- updates -------------------------------------------------------------------------
    def insert(self, token_ids: Sequence[int], blocks: Sequence[int], salt: Hashable = None) -> RadixNode:
        """Make token_ids (whole blocks, KV in `blocks`) a path cached under `salt`; returns its deepest node.
        Where a prefix is cached already, the tree keeps its own blocks and the given duplicates
        are not cached (their owner frees them)."""
        assert len(token_ids) == len(blocks) * self.block_size
        node, done = self.root, 0
        stamp = next(self._clock)
        while done < len(blocks):
            key = self._block_key(salt, token_ids, done)
            child = node.children.get(key)
            if child is None:
                leaf = RadixNode(tuple(token_ids[done * self.block_size :]), list(blocks[done:]), salt, node)
                leaf.last_access = stamp
                node.children[key] = leaf
                for block in leaf.blocks:
                    self._block_node[block] = leaf
                self.num_evictable_blocks += len(leaf.blocks)
                return leaf
            matched = self._matched_blocks(child, token_ids, done, len(blocks) - done)
            if matched < len(child.blocks):
                child = self._split(child, matched)
            child.last_access = stamp
            done += matched
            node = child
        return node

    def lock(self, node: RadixNode) -> None:
        for upper in _path_up(node):
            if upper.lock_ref == 0:
                self.num_evictable_blocks -= len(upper.blocks)
            upper.lock_ref += 1
        self.root.lock_ref += 1

    def unlock(self, node: RadixNode) -> None:
        for upper in _path_up(node):
            upper.lock_ref -= 1
            assert upper.lock_ref >= 0
            if upper.lock_ref == 0:
                self.num_evictable_blocks += len(upper.blocks)
        self.root.lock_ref -= 1

    def evict(self, num_blocks: int, is_unreferenced: Callable[[int], bool]) -> list[int]:
        """Remove up to num_blocks unlocked blocks, least recently used leaves first, trimming
        each leaf from its tail. Returns the removed blocks for the pool to free."""
        heap = [(n.last_access, id(n), n) for n in self._leaves() if n.lock_ref == 0]
        heapq.heapify(heap)
        evicted: list[int] = []
        while heap and len(evicted) < num_blocks:
            _, _, leaf = heapq.heappop(heap)
            first_block = self._child_key(leaf)
            take = min(num_blocks - len(evicted), len(leaf.blocks))
            removed = leaf.blocks[len(leaf.blocks) - take :]
            assert all(is_unreferenced(b) for b in removed), "evicting a block a request holds"
            leaf.blocks = leaf.blocks[: len(leaf.blocks) - take]
            leaf.key = leaf.key[: len(leaf.blocks) * self.block_size]
            for block in removed:
                del self._block_node[block]
            self.num_evictable_blocks -= take
            evicted += removed
            if not leaf.blocks:
                parent = _parent(leaf)
                del parent.children[first_block]
                if parent is not self.root and not parent.children and parent.lock_ref == 0:
                    heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return evicted

    def reset(self) -> list[int]:
        """Drop the whole tree; only allowed when nothing is locked. Returns the freed blocks."""
        if self.root.lock_ref != 1:
            raise RuntimeError("cannot reset the prefix cache while requests hold cached blocks")
        blocks = list(self._block_node)
        self.root.children.clear()
        self._block_node.clear()
        self.num_evictable_blocks = 0
        return blocks

    # ---- integrity -----------------------------------------------------------------------
    def check_integrity(self, locked_nodes: list[RadixNode]) -> None:
        """`locked_nodes`: each request's deepest locked node (one entry per request)."""
        expected: dict[int, int] = {}
        for node in locked_nodes:
            for upper in [*_path_up(node), self.root]:
                expected[id(upper)] = expected.get(id(upper), 0) + 1
        seen_blocks, evictable = 0, 0
        stack = [self.root]
        while stack:
            node = stack.pop()
            want = expected.get(id(node), 0) + (1 if node is self.root else 0)
            assert node.lock_ref == want, f"node lock_ref {node.lock_ref} != {want} locking requests"
            assert len(node.key) == len(node.blocks) * self.block_size, "node key is not whole blocks"
            for block in node.blocks:
                assert self._block_node.get(block) is node, f"block {block} index out of sync"
            seen_blocks += len(node.blocks)
            evictable += len(node.blocks) if node.lock_ref == 0 else 0
            for first, child in node.children.items():
                assert child.parent is node and self._child_key(child) == first, "child key out of sync"
                assert node is self.root or child.salt == node.salt, "a salted path changes its salt"
                assert child.blocks, "empty node left in the tree"
                stack.append(child)
        assert seen_blocks == len(self._block_node), "block index has blocks outside the tree"
        assert evictable == self.num_evictable_blocks, f"evictable count {self.num_evictable_blocks} != {evictable}"

    # ---- helpers -------------------------------------------------------------------------
    def _block_key(self, salt: Hashable, token_ids: Sequence[int], block_index: int) -> ChildKey:
        start = block_index * self.block_size
        return salt, tuple(token_ids[start : start + self.block_size])

    def _child_key(self, node: RadixNode) -> ChildKey:
        """`node`'s key among its parent's children."""
        return node.salt, node.key[: self.block_size]

    def _matched_blocks(self, node: RadixNode, token_ids: Sequence[int], start_block: int, limit: int) -> int:
        bs, offset = self.block_size, start_block * self.block_size
        matched = 0
        for i in range(min(len(node.blocks), limit)):
            if node.key[i * bs : (i + 1) * bs] != tuple(token_ids[offset + i * bs : offset + (i + 1) * bs]):
                break
            matched += 1
        return matched

    def _split(self, node: RadixNode, num_blocks: int) -> RadixNode:
        """Cut `node` after num_blocks blocks; returns the new upper part (the lower keeps `node`)."""
        split_at = num_blocks * self.block_size
        upper = RadixNode(node.key[:split_at], node.blocks[:num_blocks], node.salt, _parent(node))
        upper.lock_ref, upper.last_access = node.lock_ref, node.last_access
        _parent(node).children[self._child_key(node)] = upper
        node.key, node.blocks, node.parent = node.key[split_at:], node.blocks[num_blocks:], upper
        upper.children[self._child_key(node)] = node
        for block in upper.blocks:
            self._block_node[block] = upper
        return upper

    def _leaves(self) -> list[RadixNode]:
        leaves, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            else:
                leaves.append(node)
        return leaves


def _path_up(node: RadixNode) -> Iterator[RadixNode]:
    """`node` and its ancestors below the root, deepest first (nothing for the root)."""
    upper = node
    while upper.parent is not None:
        yield upper
        upper = upper.parent


def _parent(node: RadixNode) -> RadixNode:
    assert node.parent is not None, "the root has no parent"
    return node.parent
