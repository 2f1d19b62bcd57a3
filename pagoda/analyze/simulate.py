"""Replaying requests in arrival order through an idealized prefix cache, at two granularities side
by side: single tokens (a token-granular radix cache) and whole blocks of `block_size` tokens (how
Pagoda's paged radix cache, and hash-based caches such as vLLM's, see a prompt).

The server's rules, as modelled:
- a request reuses only what requests of its own cache salt (or, unsalted, unsalted ones) left;
- a request reuses the longest cached prefix in whole units, and at least one prompt token is
  always computed: reusable = min(matched units, (prompt_tokens - 1) // unit) * unit;
- a finished request leaves cached the KV it computed: its prompt and every generated token but
  the last (the last sampled token is never fed back), or just its prompt when the log has no
  output ids;
- a cache of C tokens keeps the C // unit most recently used units. A request uses every unit of
  its sequence; within one request a deeper unit counts as used earlier, so eviction always takes
  a leaf and trims branches from their tail, as a radix cache's LRU eviction does.

That LRU order nests (a smaller cache holds a subset of a larger one), so one pass yields the reuse
at every capacity: per request, the matched prefix is recorded as runs last used by the same
earlier request, each with the LRU stack depth of its first unit (`RecencyIndex`). A unit `i`
places into a run at depth `depth + i`, and it is cached at capacity C when that is below C.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import numpy as np

from pagoda.analyze.prefix_tree import PrefixTree, Run, SharedPrefix
from pagoda.analyze.recency import RecencyIndex

GRANULARITIES = ("token", "block")


@dataclass(frozen=True)
class ReplayRequest:
    line: int
    prompt_ids: np.ndarray
    output_ids: np.ndarray | None = None
    output_tokens: int | None = None
    logged_cached_tokens: int | None = None
    cache_salt: str | None = None  # the request's prefix cache namespace (vLLM's cache_salt)

    def cached_sequence(self) -> np.ndarray:
        """The tokens whose KV the request leaves cached when it finishes."""
        if self.output_ids is None or len(self.output_ids) < 2:
            return self.prompt_ids
        return np.concatenate([self.prompt_ids, self.output_ids[:-1]])


@dataclass(frozen=True)
class RunDepths:
    """Per matched run, at one granularity: its first unit's LRU stack depth and its length."""

    unit: int  # tokens per unit
    depth: np.ndarray
    units: np.ndarray


@dataclass(frozen=True)
class Simulation:
    """Per request, in arrival order (-1: not in the log), and the runs of their matches."""

    block_size: int
    lines: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    logged_cached_tokens: np.ndarray
    matched_tokens: np.ndarray  # longest prefix of the request's sequence cached earlier
    run_request: np.ndarray
    runs: dict[str, RunDepths]
    distinct_tokens: int  # tokens an unlimited cache ends up holding
    shared_prefixes: tuple[SharedPrefix, ...]

    @property
    def num_requests(self) -> int:
        return len(self.prompt_tokens)

    def reusable(self, granularity: str, cache_tokens: int | None = None) -> np.ndarray:
        """Prompt tokens each request reuses from the cache (None: unlimited capacity)."""
        runs = self.runs[granularity]
        if cache_tokens is None:
            matched_units = self.matched_tokens // runs.unit
        else:
            held = np.clip(cache_tokens // runs.unit - runs.depth, 0, runs.units)
            matched_units = np.bincount(self.run_request, weights=held, minlength=self.num_requests)
        cap_units = (self.prompt_tokens - 1) // runs.unit
        return np.minimum(matched_units.astype(np.int64), cap_units) * runs.unit


class _Granularity:
    """One granularity's LRU bookkeeping: its recency index, and per matched run the stack depth
    of the run's first unit and the run's length in units."""

    def __init__(self, unit: int) -> None:
        self.unit = unit
        self.recency = RecencyIndex()
        self.depth = array("q")
        self.units = array("q")

    def record(self, runs: list[Run], stamp: int, sequence_length: int) -> None:
        unit, recency = self.unit, self.recency
        lengths = [run.end // unit - run.start // unit for run in runs]
        self.depth.extend([recency.used_after(run.last_use) for run in runs])  # before this request's use
        self.units.extend(lengths)
        for run, length in zip(runs, lengths):
            recency.move(run.last_use, -length)
        recency.move(stamp, sequence_length // unit)

    def finish(self) -> RunDepths:
        return RunDepths(self.unit, _numpy(self.depth), _numpy(self.units))


class CacheSimulator:
    def __init__(self, block_size: int, top_prefixes: int = 5) -> None:
        self.block_size = block_size
        self.top_prefixes = top_prefixes
        self._tree = PrefixTree()
        self._granularities = dict(zip(GRANULARITIES, (_Granularity(1), _Granularity(block_size))))
        self._requests = {name: array("q") for name in ("line", "prompt", "output", "logged", "matched", "runs")}

    @property
    def num_requests(self) -> int:
        return len(self._requests["line"])

    def add(self, request: ReplayRequest) -> None:
        stamp = self.num_requests
        sequence = request.cached_sequence()
        runs = self._tree.use(sequence, stamp, request.cache_salt, len(request.prompt_ids))
        for granularity in self._granularities.values():
            granularity.record(runs, stamp, len(sequence))
        requests = self._requests
        requests["line"].append(request.line)
        requests["prompt"].append(len(request.prompt_ids))
        requests["output"].append(_or_unknown(request.output_tokens))
        requests["logged"].append(_or_unknown(request.logged_cached_tokens))
        requests["matched"].append(runs[-1].end if runs else 0)
        requests["runs"].append(len(runs))

    def finish(self) -> Simulation:
        requests = {name: _numpy(values) for name, values in self._requests.items()}
        return Simulation(
            block_size=self.block_size,
            lines=requests["line"],
            prompt_tokens=requests["prompt"],
            output_tokens=requests["output"],
            logged_cached_tokens=requests["logged"],
            matched_tokens=requests["matched"],
            run_request=np.repeat(np.arange(len(requests["runs"])), requests["runs"]),
            runs={name: granularity.finish() for name, granularity in self._granularities.items()},
            distinct_tokens=self._tree.num_tokens,
            shared_prefixes=tuple(self._tree.shared_prefixes(self.top_prefixes, self.block_size)),
        )

    def check_integrity(self) -> None:
        self._tree.check_integrity()
        for name, granularity in self._granularities.items():
            held = self._tree.count_units(granularity.unit)
            assert granularity.recency.total == held, f"{name} units out of sync"


def _numpy(values: array) -> np.ndarray:
    return np.frombuffer(values, dtype=np.int64) if len(values) else np.zeros(0, dtype=np.int64)


def _or_unknown(value: int | None) -> int:
    return -1 if value is None else value
