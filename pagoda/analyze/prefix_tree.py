"""A token-level radix tree of every token sequence a server would have cached, each node stamped
with the last request that used it. Edges are numpy arrays, compared with one vectorized `!=` per
node, so a request costs a few dictionary lookups and comparisons, not one step per token.

One root per cache salt (a request's `cache_salt`, None for none): the server shares cached KV
only between requests of the same salt, so each salt's sequences form a tree of their own.

Invariants (`check_integrity`):
- Siblings differ in their first token; only the roots have no tokens.
- All tokens of a node were last used by the same request, `last_use`, and a parent's `last_use`
  is >= its children's: a request that uses a token uses every token before it. (A node is split
  wherever a request stops using it part-way, which keeps this true.)
- `uses` is the number of requests that wrote the node (the first) or met its whole prefix within
  their prompt (the tokens a cache could serve them; a greedy output that writes the same tokens
  again reads none), so a parent's `uses` is >= its children's; `end` is the length of that prefix.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np


class _Node:
    __slots__ = ("tokens", "children", "parent", "end", "last_use", "uses")

    def __init__(self, tokens: np.ndarray, parent: _Node | None, end: int, last_use: int, uses: int) -> None:
        self.tokens = tokens
        self.children: dict[int, _Node] = {}
        self.parent = parent
        self.end = end
        self.last_use = last_use
        self.uses = uses


class Run(NamedTuple):
    """Matched positions [start, end) of a sequence, all last used by request `last_use`."""

    last_use: int
    start: int
    end: int


@dataclass(frozen=True)
class SharedPrefix:
    tokens: np.ndarray
    requests: int  # requests whose token sequence starts with `tokens`


class PrefixTree:
    def __init__(self) -> None:
        self._roots: dict[str | None, _Node] = {}  # by cache salt
        self.num_tokens = 0  # distinct prefixes held, i.e. tokens in the trees

    def use(self, seq: np.ndarray, stamp: int, salt: str | None = None, prompt_len: int | None = None) -> list[Run]:
        """The longest prefix of `seq` already in `salt`'s tree, as runs of equal `last_use` (those
        fall from run to run); then all of `seq` is in that tree, last used by `stamp`. A request uses
        (`uses`) the nodes it meets within its first `prompt_len` tokens (all where None): what it
        could read from a cache, not the tokens its output writes again."""
        prompt_len = len(seq) if prompt_len is None else prompt_len
        runs: list[Run] = []
        root = self._roots.get(salt)
        if root is None:
            root = self._roots[salt] = _Node(np.empty(0, dtype=np.int32), None, 0, -1, 0)
        node, pos = root, 0
        while pos < len(seq):
            child = node.children.get(int(seq[pos]))
            if child is None:
                break
            matched = _common_prefix(child.tokens, seq[pos:])
            if pos < prompt_len < pos + matched:  # the prompt ends inside: split there, the rest met next
                matched = prompt_len - pos
            if matched < len(child.tokens):
                child = self._split(child, matched)
            if runs and runs[-1].last_use == child.last_use:
                runs[-1] = Run(child.last_use, runs[-1].start, pos + matched)
            else:
                runs.append(Run(child.last_use, pos, pos + matched))
            child.last_use = stamp
            child.uses += pos + matched <= prompt_len
            node, pos = child, pos + matched
        if pos < len(seq):
            node.children[int(seq[pos])] = _Node(seq[pos:].copy(), node, len(seq), stamp, 1)
            self.num_tokens += len(seq) - pos
        return runs

    def shared_prefixes(self, limit: int, min_tokens: int) -> list[SharedPrefix]:
        """The `limit` prefixes of `min_tokens` or more that two or more requests use, with the most
        tokens reusable by the later ones: (requests - 1) * length."""
        shared = (node for node in self._nodes() if node.uses >= 2 and node.end >= min_tokens)
        top = heapq.nlargest(limit, shared, key=lambda node: ((node.uses - 1) * node.end, node.end))
        return [SharedPrefix(self._prefix(node), node.uses) for node in top]

    def count_units(self, unit: int) -> int:
        """Whole units of `unit` tokens held: one per position that ends a unit."""
        return sum(node.end // unit - (node.end - len(node.tokens)) // unit for node in self._nodes())

    def check_integrity(self) -> None:
        held = 0
        for node in self._nodes():
            parent = node.parent
            assert len(node.tokens) > 0, "a node without tokens"
            assert parent.children.get(int(node.tokens[0])) is node, "child keyed by another token"
            assert node.end == parent.end + len(node.tokens), "end out of sync"
            assert parent.parent is None or parent.last_use >= node.last_use, "child used after its parent"
            assert parent.parent is None or parent.uses >= node.uses, "child used more than its parent"
            held += len(node.tokens)
        assert held == self.num_tokens, f"num_tokens {self.num_tokens} != {held} held"

    def _split(self, node: _Node, at: int) -> _Node:
        """Cut `node` after `at` tokens; returns the new upper part."""
        upper = _Node(node.tokens[:at], node.parent, node.end - len(node.tokens) + at, node.last_use, node.uses)
        node.parent.children[int(node.tokens[0])] = upper
        node.tokens, node.parent = node.tokens[at:], upper
        upper.children[int(node.tokens[0])] = node
        return upper

    def _nodes(self) -> Iterator[_Node]:
        stack = [child for root in self._roots.values() for child in root.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _prefix(self, node: _Node) -> np.ndarray:
        parts = []
        while node.parent is not None:
            parts.append(node.tokens)
            node = node.parent
        return np.concatenate(parts[::-1])


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the common prefix of two non-empty arrays."""
    n = min(len(a), len(b))
    differs = a[:n] != b[:n]
    first = int(differs.argmax())
    return first if differs[first] else n
