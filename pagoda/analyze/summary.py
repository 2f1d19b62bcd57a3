"""The numbers a report shows, computed once from a finished analysis. Plain types only, so the
JSON output is `dataclasses.asdict` of them."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pagoda.analyze.logs import Malformed
from pagoda.analyze.pipeline import Analysis
from pagoda.analyze.routing import RoutedReplay
from pagoda.analyze.simulate import GRANULARITIES, Simulation

CURVE_POINTS = 10
HISTOGRAM_EDGES = tuple(i / 10 for i in range(11))
DIFFERENCES_KEPT = 5


@dataclass(frozen=True)
class Reuse:
    tokens: int  # prompt tokens served from the cache
    share: float  # of all prompt tokens


@dataclass(frozen=True)
class CachePoint:
    cache_tokens: int | None  # None: unlimited
    token: Reuse  # token granularity (a radix cache)
    block: Reuse  # whole blocks (Pagoda's paged cache, vLLM's hashed blocks)


@dataclass(frozen=True)
class HitRatios:
    """Per request, the share of its prompt an unlimited cache serves."""

    no_reuse: int  # requests that reuse nothing
    histogram_edges: tuple[float, ...]
    histogram_counts: tuple[int, ...]  # the other requests, by share reused
    median: float
    p90: float
    mean: float


@dataclass(frozen=True)
class SharedPrefixLine:
    tokens: int
    requests: int
    text: str  # its first characters


@dataclass(frozen=True)
class ServerCheck:
    """The server's own cached_tokens from the log against the block-granular prediction."""

    requests: int  # requests whose line logs cached_tokens
    logged_cached_tokens: int
    predicted_cached_tokens: int  # unlimited cache, for the same requests
    exact: int  # requests where the two agree
    differences: tuple[tuple[int, int, int], ...]  # (line, predicted, logged), the first few


@dataclass(frozen=True)
class RoutingPoint:
    cache_tokens: int | None  # each replica's cache; None: unlimited
    reused: Reuse  # prompt tokens served from the replicas' caches, in whole blocks: prefill saved
    prefill_tokens: int  # prompt tokens the replicas still compute


@dataclass(frozen=True)
class RoutingSummary:
    """One routing policy over N replicas (routing.py)."""

    policy: str
    requests_per_replica: tuple[int, ...]
    imbalance: float  # the busiest replica's requests over the mean: 1.0 is an even spread
    points: tuple[RoutingPoint, ...]  # unlimited first, then each --cache-tokens size


@dataclass(frozen=True)
class Summary:
    log: str
    block_size: int
    requests: int
    malformed_lines: int
    malformed: tuple[Malformed, ...]
    prompt_tokens: int
    output_tokens: int | None  # over the requests whose output is logged
    requests_without_output: int
    prefill_share: float | None  # prompt / (prompt + output), requests with a logged output
    distinct_tokens: int  # what an unlimited token-granular cache ends up holding
    unlimited: CachePoint
    capacity_curve: tuple[CachePoint, ...]
    hit_ratios: dict[str, HitRatios]  # by granularity
    shared_prefixes: tuple[SharedPrefixLine, ...]
    server_check: ServerCheck | None
    routing: tuple[RoutingSummary, ...] = ()  # with --replicas N > 1


def default_capacities(distinct_tokens: int, block_size: int) -> tuple[int, ...]:
    """Powers of two from one block up to (not including) the distinct tokens, the largest few."""
    sizes = [2**k for k in range(63) if block_size <= 2**k < distinct_tokens]
    return tuple(sizes[-CURVE_POINTS:])


def summarize(analysis: Analysis, capacities: tuple[int, ...] | None = None) -> Summary:
    sim = analysis.simulation
    known_output = sim.output_tokens >= 0
    prompt_total = int(sim.prompt_tokens.sum())
    output_total = int(sim.output_tokens[known_output].sum()) if known_output.any() else None
    sizes = default_capacities(sim.distinct_tokens, sim.block_size) if capacities is None else capacities
    return Summary(
        log=str(analysis.path),
        block_size=sim.block_size,
        requests=sim.num_requests,
        malformed_lines=analysis.malformed_count,
        malformed=analysis.malformed,
        prompt_tokens=prompt_total,
        output_tokens=output_total,
        requests_without_output=int((~known_output).sum()),
        prefill_share=_prefill_share(sim, known_output),
        distinct_tokens=sim.distinct_tokens,
        unlimited=_cache_point(sim, None, prompt_total),
        capacity_curve=tuple(_cache_point(sim, size, prompt_total) for size in sorted(sizes)),
        hit_ratios={g: _hit_ratios(sim.reusable(g) / sim.prompt_tokens) for g in GRANULARITIES},
        shared_prefixes=tuple(
            SharedPrefixLine(len(prefix.tokens), prefix.requests, text)
            for prefix, text in zip(sim.shared_prefixes, analysis.prefix_previews)
        ),
        server_check=_server_check(sim),
        routing=tuple(_routing(replay, capacities or (), prompt_total) for replay in analysis.routing),
    )


def _routing(replay: RoutedReplay, capacities: tuple[int, ...], prompt_total: int) -> RoutingSummary:
    counts = np.bincount(replay.assignment, minlength=len(replay.replicas))
    points = []
    for size in (None, *sorted(capacities)):
        reused = int(replay.reusable(size).sum())
        points.append(RoutingPoint(size, Reuse(reused, reused / prompt_total), prompt_total - reused))
    return RoutingSummary(
        replay.policy, tuple(int(c) for c in counts), float(counts.max() / counts.mean()), tuple(points)
    )


def _prefill_share(sim: Simulation, known_output: np.ndarray) -> float | None:
    if not known_output.any():
        return None
    prompt = int(sim.prompt_tokens[known_output].sum())
    return prompt / (prompt + int(sim.output_tokens[known_output].sum()))


def _cache_point(sim: Simulation, cache_tokens: int | None, prompt_total: int) -> CachePoint:
    reuse = {g: int(sim.reusable(g, cache_tokens).sum()) for g in GRANULARITIES}
    return CachePoint(cache_tokens, *(Reuse(reuse[g], reuse[g] / prompt_total) for g in GRANULARITIES))


def _hit_ratios(ratios: np.ndarray) -> HitRatios:
    counts, _ = np.histogram(ratios[ratios > 0], bins=HISTOGRAM_EDGES)
    return HitRatios(
        no_reuse=int((ratios == 0).sum()),
        histogram_edges=HISTOGRAM_EDGES,
        histogram_counts=tuple(int(c) for c in counts),
        median=float(np.median(ratios)),
        p90=float(np.quantile(ratios, 0.9)),
        mean=float(ratios.mean()),
    )


def _server_check(sim: Simulation) -> ServerCheck | None:
    logged = sim.logged_cached_tokens >= 0
    if not logged.any():
        return None
    predicted, actual = sim.reusable("block")[logged], sim.logged_cached_tokens[logged]
    lines = sim.lines[logged]
    differ = np.flatnonzero(predicted != actual)[:DIFFERENCES_KEPT]
    return ServerCheck(
        requests=int(logged.sum()),
        logged_cached_tokens=int(actual.sum()),
        predicted_cached_tokens=int(predicted.sum()),
        exact=int((predicted == actual).sum()),
        differences=tuple((int(lines[i]), int(predicted[i]), int(actual[i])) for i in differ),
    )
