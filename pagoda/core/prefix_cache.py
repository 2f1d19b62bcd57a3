"""The prefix cache as the KV cache manager sees it: one interface, implemented by the radix tree
(`RadixCache`) and by `NoPrefixCache` for `--no-enable-prefix-caching`. Pure Python.

A cache keeps KV blocks that no request holds any more, keyed by the tokens they store, and hands
them to later requests with the same prefix. Its blocks come from the pool; it never frees one
itself: `evict` and `reset` return the blocks they drop, for the pool to release.

Protocol, for a request's life: `find` (a pure query) -> `touch` (take the hit: LRU stamp, node
split) -> `lock` the returned node while the request uses it -> `insert` what the request computed
and lock that node instead -> `unlock` when the request ends. Locked nodes are never evicted.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

Node = TypeVar("Node")


@dataclass(frozen=True)
class PrefixMatch(Generic[Node]):
    """A reusable prefix: its blocks in token order and, when it came from the cache, where it ends
    (the deepest node it reaches, of which it covers the first `num_node_blocks` blocks). `node`
    is None for a miss and for blocks shared by an n > 1 sibling rather than by the cache."""

    blocks: tuple[int, ...]
    node: Node | None = None
    num_node_blocks: int = 0


class PrefixCache(Protocol[Node]):
    block_size: int

    @property
    def num_cached_blocks(self) -> int: ...

    @property
    def num_evictable_blocks(self) -> int:
        """Cached blocks no request locks: the pool may take them back."""

    def is_cached(self, block: int) -> bool: ...

    def cached_blocks(self) -> set[int]: ...

    def find(self, token_ids: Sequence[int], max_blocks: int, salt: Hashable = None) -> PrefixMatch[Node]:
        """The longest prefix of whole blocks cached under `salt` (a namespace: None, or a request's
        cache_namespace), at most `max_blocks`; changes nothing."""

    def touch(self, match: PrefixMatch[Node]) -> Node:
        """Take a hit that `find` just returned; returns the node to lock for it."""

    def insert(self, token_ids: Sequence[int], blocks: Sequence[int], salt: Hashable = None) -> Node:
        """Cache `blocks` (whole blocks of `token_ids`) under `salt`; returns the node that ends the path.
        Where a prefix is cached already, the cache keeps its own blocks (see `path_blocks`)."""

    def path_blocks(self, node: Node) -> list[int]:
        """The cache's blocks from the start of the sequence to `node`, in token order."""

    def lock(self, node: Node) -> None: ...

    def unlock(self, node: Node) -> None: ...

    def evict(self, num_blocks: int, is_unreferenced: Callable[[int], bool]) -> list[int]:
        """Drop up to `num_blocks` unlocked blocks; returns them for the pool to free."""

    def reset(self) -> list[int]:
        """Drop everything (nothing may be locked); returns the dropped blocks."""

    def check_integrity(self, locked_nodes: list[Node]) -> None: ...


class NoPrefixCache:
    """Caches nothing: every query misses, inserts keep nothing, locks are free."""

    _END = object()  # the one node `insert` returns: the empty path

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    num_cached_blocks = 0
    num_evictable_blocks = 0

    def is_cached(self, block: int) -> bool:
        return False

    def cached_blocks(self) -> set[int]:
        return set()

    def find(self, token_ids: Sequence[int], max_blocks: int, salt: Hashable = None) -> PrefixMatch[object]:
        return PrefixMatch(())

    def touch(self, match: PrefixMatch[object]) -> object:
        return match.node

    def insert(self, token_ids: Sequence[int], blocks: Sequence[int], salt: Hashable = None) -> object:
        return self._END

    def path_blocks(self, node: object) -> list[int]:
        return []

    def lock(self, node: object) -> None:
        pass

    def unlock(self, node: object) -> None:
        pass

    def evict(self, num_blocks: int, is_unreferenced: Callable[[int], bool]) -> list[int]:
        return []

    def reset(self) -> list[int]:
        return []

    def check_integrity(self, locked_nodes: list[object]) -> None:
        assert all(node is self._END for node in locked_nodes), "a lock on a node this cache never made"
