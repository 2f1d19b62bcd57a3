"""LRU stack depth for every cache size in one pass (Mattson's stack algorithm).

A cache that keeps the C most recently used units holds a unit exactly when fewer than C other
units were used after it. This index answers "how many units were last used after request t?"
with a Fenwick tree over request stamps that counts, per request, the units it used last.
"""

from __future__ import annotations


class RecencyIndex:
    def __init__(self, size: int = 1024) -> None:
        self._counts = [0] * (size + 1)  # 1-based: stamp t lives at index t + 1
        self._tree = [0] * (size + 1)
        self.total = 0

    def move(self, stamp: int, units: int) -> None:
        """Add `units` (negative: remove them) to those last used by request `stamp`."""
        index = stamp + 1
        if index >= len(self._tree):
            self._grow(index)
        self._counts[index] += units
        self.total += units
        tree, size = self._tree, len(self._tree)
        while index < size:
            tree[index] += units
            index += index & -index

    def used_after(self, stamp: int) -> int:
        """Units whose last use came after request `stamp`."""
        tree, index, before = self._tree, min(stamp + 1, len(self._tree) - 1), 0
        while index > 0:
            before += tree[index]
            index -= index & -index
        return self.total - before

    def _grow(self, index: int) -> None:
        size = max(2 * (len(self._tree) - 1), index)
        self._counts += [0] * (size + 1 - len(self._counts))
        tree = list(self._counts)
        for i in range(1, size + 1):
            parent = i + (i & -i)
            if parent <= size:
                tree[parent] += tree[i]
        self._tree = tree
