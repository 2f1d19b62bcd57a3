"""The routing forecast: the log replayed through N replicas, each with its own prefix cache, under
the routing policies of SGLang Model Gateway (`smg` 1.13.0, what `pagoda serve
--data-parallel-size` runs). Each replica is a `CacheSimulator`, so every cache size comes out of
one pass, as for one server.

The gateway's `cache_aware` policy with HTTP workers, as modelled (its --help and source):
- it keeps one approximate radix tree of the *text* it has routed (characters, not tokens: a
  chat request's text is its messages' text contents joined by spaces, a completion's its prompt),
  each node tagged with the workers it was sent to; it never learns what a replica evicted;
- a request whose longest matched prefix is more than `cache_threshold` (0.3) of its text goes to
  the least-loaded worker among those holding that prefix; unless that worker is over the spill
  gate (load above `balance_rel_threshold` (1.5) times the fleet mean and above the mean by a
  margin: `balance_abs_threshold` (64) capped at two standard deviations of the in-flight count
  at that mean, never under 4), then to the least-loaded worker;
- any other request goes to the least-loaded worker (its expected-wait fallback);
- the chosen worker is then recorded as holding the request's whole text.
Load is the requests in flight on a worker. Ties the gateway breaks at random go here to the
worker sent the fewest requests so far, then the lowest index (the same shares on average).
`round-robin` sends request i to worker i mod N.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from pagoda.analyze.simulate import CacheSimulator, ReplayRequest, Simulation

POLICIES = ("round-robin", "cache-aware")
CACHE_THRESHOLD = 0.3  # smg --cache-threshold
BALANCE_ABS_THRESHOLD = 64  # smg --balance-abs-threshold
BALANCE_REL_THRESHOLD = 1.5  # smg --balance-rel-threshold
MIN_SPILL_MARGIN = 4


class TextTree:
    """The gateway's approximate tree: a character radix tree whose nodes record the workers that
    were sent a text through them. `match` walks it without changing it."""

    def __init__(self) -> None:
        self._root = _TextNode("", set())

    def match(self, text: str) -> tuple[int, set[int]]:
        """(characters of `text` matched, the workers holding the deepest node reached)."""
        node, pos = self._root, 0
        while pos < len(text):
            child = node.children.get(text[pos])
            if child is None:
                break
            shared = _common_prefix(child.text, text, pos)
            pos, node = pos + shared, child
            if shared < len(child.text):
                break
        return pos, (set(node.workers) if pos else set())

    def insert(self, text: str, worker: int) -> None:
        node, pos = self._root, 0
        while pos < len(text):
            child = node.children.get(text[pos])
            if child is None:
                node.children[text[pos]] = _TextNode(text[pos:], {worker})
                return
            shared = _common_prefix(child.text, text, pos)
            if shared < len(child.text):
                child = child.split(shared, node)
            child.workers.add(worker)
            pos, node = pos + shared, child


class _TextNode:
    __slots__ = ("text", "workers", "children")

    def __init__(self, text: str, workers: set[int]) -> None:
        self.text = text
        self.workers = workers
        self.children: dict[str, _TextNode] = {}

    def split(self, at: int, parent: _TextNode) -> _TextNode:
        """Cut after `at` characters; returns the new upper part (holding the same workers)."""
        upper = _TextNode(self.text[:at], set(self.workers))
        parent.children[self.text[0]] = upper
        self.text = self.text[at:]
        upper.children[self.text[0]] = self
        return upper


def _common_prefix(edge: str, text: str, pos: int) -> int:
    n = min(len(edge), len(text) - pos)
    if edge[:n] == text[pos : pos + n]:
        return n
    lo, hi = 1, n  # edge[0] == text[pos]; binary search the first difference on C-speed slices
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if edge[:mid] == text[pos : pos + mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass
class Gateway:
    """One routing policy over `replicas` workers; `route` picks a worker for a request."""

    policy: str
    replicas: int
    cache_threshold: float = CACHE_THRESHOLD

    def __post_init__(self) -> None:
        self.tree = TextTree()
        self.sent = [0] * self.replicas

    def route(self, text: str, loads: list[int]) -> int:
        if self.policy == "round-robin":
            worker = sum(self.sent) % self.replicas
        else:
            worker = self._cache_aware(text, loads)
            self.tree.insert(text, worker)
        self.sent[worker] += 1
        return worker

    def _cache_aware(self, text: str, loads: list[int]) -> int:
        matched, holders = self.tree.match(text)
        if not text or matched / len(text) <= self.cache_threshold:
            return self._least_loaded(range(self.replicas), loads)
        chosen = self._least_loaded(holders, loads)
        return self._least_loaded(range(self.replicas), loads) if _over_spill_gate(loads[chosen], loads) else chosen

    def _least_loaded(self, workers, loads: list[int]) -> int:
        return min(workers, key=lambda w: (loads[w], self.sent[w], w))


def _over_spill_gate(load: int, loads: list[int]) -> bool:
    mean = sum(loads) / len(loads)
    margin = min(BALANCE_ABS_THRESHOLD, max(MIN_SPILL_MARGIN, 2 * math.sqrt(mean)))
    return load > mean * BALANCE_REL_THRESHOLD and load > mean + margin


@dataclass(frozen=True)
class RoutedReplay:
    """One policy's outcome: per request (in replay order) the replica it went to, and each
    replica's cache simulation over the requests it served."""

    policy: str
    assignment: np.ndarray
    replicas: tuple[Simulation, ...]

    def reusable(self, cache_tokens: int | None = None) -> np.ndarray:
        """Prompt tokens each request reuses in whole blocks on its replica (None: unlimited)."""
        out = np.zeros(len(self.assignment), dtype=np.int64)
        for replica, sim in enumerate(self.replicas):
            out[self.assignment == replica] = sim.reusable("block", cache_tokens)
        return out


class RoutingReplay:
    """Feeds each request to one policy's gateway model and to the cache of the replica it picks.
    Loads come from the log's timings: a request is in flight from its arrival (timestamp minus
    latency_s) to its finish (timestamp); without timings, each finishes before the next arrives."""

    def __init__(self, policy: str, replicas: int, block_size: int, cache_threshold: float = CACHE_THRESHOLD) -> None:
        self.gateway = Gateway(policy, replicas, cache_threshold)
        self.caches = [CacheSimulator(block_size, top_prefixes=0) for _ in range(replicas)]
        self.assignment: list[int] = []
        self.finishes: list[list[float]] = [[] for _ in range(replicas)]

    def add(self, request: ReplayRequest, text: str, arrival: float | None, finish: float | None) -> None:
        loads = [sum(1 for f in finishes if arrival is not None and f > arrival) for finishes in self.finishes]
        worker = self.gateway.route(text, loads)
        self.caches[worker].add(request)
        self.assignment.append(worker)
        if finish is not None:
            kept = [f for f in self.finishes[worker] if arrival is None or f > arrival]
            self.finishes[worker] = [*kept, finish]

    def finish(self) -> RoutedReplay:
        return RoutedReplay(
            self.gateway.policy,
            np.array(self.assignment, dtype=np.int64),
            tuple(cache.finish() for cache in self.caches),
        )


def request_text(prompt: object) -> str:
    """The text the gateway matches on: a completion's prompt, or a chat request's messages' text
    contents joined by spaces; token ids give none."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, tuple):
        return " ".join(text for message in prompt if (text := _content_text(message.get("content"))))
    return ""


def _content_text(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(part.get("text", "") for part in content if isinstance(part, dict) and part.get("text"))
    return ""
