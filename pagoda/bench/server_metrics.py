"""Prefix-cache hit rate over a run, from the server's Prometheus /metrics before and after.

Counters give the exact rate over the run: (hits after - hits before) / (queries after -
queries before), in tokens. Names, with or without prometheus_client's `_total` suffix:
  Pagoda  pagoda:prefix_cache_hits / pagoda:prefix_cache_queries
  vLLM    vllm:prefix_cache_hits / vllm:prefix_cache_queries (older: vllm:gpu_prefix_cache_*)
SGLang exports only a gauge, sglang:cache_hit_rate, over its own recent window; it is reported
as read after the run and marked as such.
"""

from __future__ import annotations

from dataclasses import dataclass

import aiohttp

from pagoda.bench.client import get_text

COUNTER_PAIRS = (
    ("pagoda", "pagoda:prefix_cache_hits", "pagoda:prefix_cache_queries"),
    ("vllm", "vllm:prefix_cache_hits", "vllm:prefix_cache_queries"),
    ("vllm", "vllm:gpu_prefix_cache_hits", "vllm:gpu_prefix_cache_queries"),
)
GAUGES = (("sglang", "sglang:cache_hit_rate"),)


@dataclass(frozen=True)
class PrefixCacheStats:
    source: str  # e.g. "pagoda counters", "sglang gauge after the run"
    hit_rate: float | None  # None when the server saw no prefix-cache queries in the run
    hit_tokens: float | None = None
    query_tokens: float | None = None


def parse_prometheus(text: str) -> dict[str, float]:
    """Sample values by metric name, summed over label sets (several models or engines)."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, rest = _split_sample(line)
        fields = rest.split()
        if not name or not fields:
            continue
        try:
            values[name] = values.get(name, 0.0) + float(fields[0])
        except ValueError:
            continue
    return values


def _split_sample(line: str) -> tuple[str, str]:
    """(name, text after the labels); label values may hold spaces, braces and escaped quotes."""
    brace = line.find("{")
    space = line.find(" ")
    if brace < 0 or 0 <= space < brace:
        name, _, rest = line.partition(" ")
        return name, rest
    quoted = escaped = False
    for i in range(brace + 1, len(line)):
        char = line[i]
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = True
        elif char == '"':
            quoted = not quoted
        elif char == "}" and not quoted:
            return line[:brace], line[i + 1 :]
    return "", ""


def _counter(values: dict[str, float], name: str) -> float | None:
    return values.get(f"{name}_total", values.get(name))


def prefix_cache_stats(before: dict[str, float], after: dict[str, float]) -> PrefixCacheStats | None:
    """The run's hit rate from two scrapes; None when the server exports none of the known names."""
    for engine, hits_name, queries_name in COUNTER_PAIRS:
        hits0, queries0 = _counter(before, hits_name), _counter(before, queries_name)
        hits1, queries1 = _counter(after, hits_name), _counter(after, queries_name)
        if None in (hits0, queries0, hits1, queries1):
            continue
        hits, queries = hits1 - hits0, queries1 - queries0  # type: ignore[operator]
        return PrefixCacheStats(f"{engine} counters", hits / queries if queries > 0 else None, hits, queries)
    for engine, gauge in GAUGES:
        if gauge in after:
            return PrefixCacheStats(f"{engine} gauge after the run", after[gauge])
    return None


async def scrape(http: aiohttp.ClientSession, url: str) -> dict[str, float] | None:
    """The server's metrics, or None when it has none or does not answer within 10 s."""
    try:
        status, text = await get_text(http, url, 10.0)
    except (aiohttp.ClientError, TimeoutError):
        return None
    return parse_prometheus(text) if status == 200 else None
