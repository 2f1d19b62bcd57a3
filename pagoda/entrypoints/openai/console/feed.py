"""The console's live feed: what the engine's counters and the finished requests say, sampled once
a second into a ring buffer of the last ten minutes.

One owner each: the engine thread publishes SchedulerStats (AsyncEngine.stats), the request
recorder hands each finished request's non-prompt fields to RecentRequests, and EngineFeed only
reads both on the event loop. Nothing here runs on the engine thread or holds a lock.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass

from pagoda.core.outputs import SchedulerStats

SAMPLE_INTERVAL_S = 1.0
HISTORY_S = 600  # the dashboard's plots span the last ten minutes
WINDOW_S = 60.0  # percentiles and the recent hit rate are over the last minute
RECENT_ROWS = 50  # rows the requests table shows
MAX_WINDOW_ROWS = 10_000  # percentiles are over at most this many of the last minute's requests


@dataclass(frozen=True)
class RequestRow:
    """One finished engine request, as the request log has it, less the prompt and output."""

    seq: int
    request_id: str
    endpoint: str
    finished: float  # Unix time
    prompt_tokens: int
    output_tokens: int  # over all n sequences
    cached_tokens: int
    ttft_s: float | None
    tpot_s: float | None
    latency_s: float | None
    finish_reason: str
    prompt: str | None = None  # only where the server logs prompts (--log-prompts)


class RecentRequests:
    """The last minute's finished requests (at most MAX_WINDOW_ROWS), newest last."""

    def __init__(self) -> None:
        self._rows: deque[tuple[float, RequestRow]] = deque(maxlen=MAX_WINDOW_ROWS)
        self._seq = itertools.count(1)

    def add(self, row: dict, now: float) -> None:
        """`row`: RequestRow's fields but `seq`; `now`: time.monotonic()."""
        self._rows.append((now, RequestRow(seq=next(self._seq), **row)))
        self._expire(now)

    def latest(self, after: int = 0, limit: int = RECENT_ROWS) -> list[RequestRow]:
        """The newest `limit` rows with seq > `after`, oldest first."""
        rows = [row for _, row in itertools.islice(reversed(self._rows), limit) if row.seq > after]
        return rows[::-1]

    def window(self, now: float) -> list[RequestRow]:
        """Rows of requests that finished in the last WINDOW_S seconds."""
        self._expire(now)
        return [row for finished, row in self._rows if finished >= now - WINDOW_S]

    def _expire(self, now: float) -> None:
        # keep RECENT_ROWS regardless, so an idle server still shows its last requests
        while len(self._rows) > RECENT_ROWS and self._rows[0][0] < now - WINDOW_S:
            self._rows.popleft()


@dataclass(frozen=True)
class Sample:
    """The engine one second at a time. Rates are over the interval since the previous sample."""

    seq: int
    time: float  # Unix time
    running: int
    waiting: int
    kv_usage: float  # 0..1
    prompt_tps: float  # prompt tokens computed per second (prefix-cache hits are not computed)
    generation_tps: float
    preemptions: int  # since start
    hit_rate_minute: float | None  # prefix-cache hits / lookups over the last minute; None: no lookups
    hit_rate_total: float | None  # since start
    ttft_p50: float | None  # seconds, over requests that finished in the last minute
    ttft_p90: float | None
    ttft_p99: float | None
    tpot_p50: float | None
    tpot_p90: float | None
    tpot_p99: float | None
    finished_minute: int  # requests that finished in the last minute


@dataclass(frozen=True)
class _Reading:
    stats: SchedulerStats
    monotonic: float


class EngineFeed:
    """Samples the engine once a second while `run()` runs; the console's endpoint reads `since()`."""

    def __init__(self, stats: Callable[[], SchedulerStats], requests: RecentRequests) -> None:
        self._stats = stats
        self.requests = requests
        self._samples: deque[Sample] = deque(maxlen=int(HISTORY_S / SAMPLE_INTERVAL_S))
        self._readings: deque[_Reading] = deque(maxlen=int(WINDOW_S / SAMPLE_INTERVAL_S) + 1)
        self._seq = itertools.count(1)
        # this server's feed: a page that polled an earlier server on the same address (its
        # counters restart at 1 here) sees a new value and reads from the start
        self.instance = uuid.uuid4().hex

    async def run(self, interval_s: float = SAMPLE_INTERVAL_S) -> None:
        """Sample every `interval_s` until cancelled (the app's lifespan owns the task)."""
        self._readings.append(_Reading(self._stats(), time.monotonic()))
        while True:
            await asyncio.sleep(interval_s)
            self.sample()

    def sample(self) -> Sample:
        now = time.monotonic()
        reading = _Reading(self._stats(), now)
        previous = self._readings[-1] if self._readings else reading
        minute_ago = self._readings[0] if self._readings else reading
        self._readings.append(reading)
        s, p = reading.stats, previous.stats
        elapsed = max(now - previous.monotonic, 1e-9)
        window = self.requests.window(now)
        ttft = _percentiles([r.ttft_s for r in window if r.ttft_s is not None])
        tpot = _percentiles([r.tpot_s for r in window if r.tpot_s is not None])
        sample = Sample(
            seq=next(self._seq),
            time=time.time(),
            running=s.num_running,
            waiting=s.num_waiting,
            kv_usage=s.kv_usage,
            prompt_tps=(s.prompt_tokens - p.prompt_tokens) / elapsed,
            generation_tps=(s.generation_tokens - p.generation_tokens) / elapsed,
            preemptions=s.num_preemptions,
            hit_rate_minute=_ratio(
                s.prefix_cache_hits - minute_ago.stats.prefix_cache_hits,
                s.prefix_cache_queries - minute_ago.stats.prefix_cache_queries,
            ),
            hit_rate_total=_ratio(s.prefix_cache_hits, s.prefix_cache_queries),
            ttft_p50=ttft[0],
            ttft_p90=ttft[1],
            ttft_p99=ttft[2],
            tpot_p50=tpot[0],
            tpot_p90=tpot[1],
            tpot_p99=tpot[2],
            finished_minute=len(window),
        )
        self._samples.append(sample)
        return sample

    def since(self, after_sample: int = 0, after_request: int = 0) -> dict:
        """The samples and request rows newer than the ones a page already has (0: all held)."""
        return {
            "instance": self.instance,
            "samples": [asdict(s) for s in self._samples if s.seq > after_sample],
            "requests": [asdict(r) for r in self.requests.latest(after_request)],
        }


def _ratio(part: int, whole: int) -> float | None:
    return part / whole if whole else None


def _percentiles(values: list[float]) -> tuple[float | None, float | None, float | None]:
    """p50, p90, p99 by linear interpolation (numpy's default), or Nones for no values."""
    if not values:
        return None, None, None
    ordered = sorted(values)

    def at(q: float) -> float:
        position = q * (len(ordered) - 1)
        low = math.floor(position)
        high = min(low + 1, len(ordered) - 1)
        return ordered[low] + (ordered[high] - ordered[low]) * (position - low)

    return at(0.5), at(0.9), at(0.99)
