"""The periodic engine line of `pagoda serve`, in vLLM's words so that tools reading vLLM's logs
read it too:

    Avg prompt throughput: 812.4 tokens/s, Avg generation throughput: 95.1 tokens/s, Running: 8 reqs,
    Waiting: 2 reqs, Preemptions: 0, CPU KV cache usage: 41.3%, Prefix cache hit rate: 37.5%

With speculative decoding on, an interval in which requests speculated adds the mean acceptance
length (tokens per verifying step: accepted drafts + 1) and the draft acceptance rate.

Rates are computed on the event loop from two successive SchedulerStats snapshots (cumulative
counters the engine thread publishes), so the engine thread does no extra work for them. Lines of an
idle interval go to debug, so an idle server's log stays quiet.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from pagoda.core.outputs import SchedulerStats

logger = logging.getLogger("pagoda.stats")

DEFAULT_INTERVAL_S = 10.0


@dataclass(frozen=True)
class Snapshot:
    stats: SchedulerStats
    time: float  # time.monotonic()


def stats_line(before: Snapshot, after: Snapshot, kv_device: str) -> str:
    """The line for the interval between two snapshots."""
    elapsed = max(after.time - before.time, 1e-9)
    a, b = after.stats, before.stats
    parts = [
        f"Avg prompt throughput: {(a.prompt_tokens - b.prompt_tokens) / elapsed:.1f} tokens/s",
        f"Avg generation throughput: {(a.generation_tokens - b.generation_tokens) / elapsed:.1f} tokens/s",
        f"Running: {a.num_running} reqs",
        f"Waiting: {a.num_waiting} reqs",
        f"Preemptions: {a.num_preemptions - b.num_preemptions}",
        f"{kv_device} KV cache usage: {a.kv_usage * 100:.1f}%",
    ]
    if a.prefix_cache_queries:  # since start, as /metrics counts it
        parts.append(f"Prefix cache hit rate: {a.prefix_cache_hits / a.prefix_cache_queries * 100:.1f}%")
    drafts = a.spec_num_drafts - b.spec_num_drafts
    if drafts:  # in the interval, as vLLM's SpecDecoding line
        accepted = a.spec_num_accepted_tokens - b.spec_num_accepted_tokens
        proposed = a.spec_num_draft_tokens - b.spec_num_draft_tokens
        parts.append(f"Mean acceptance length: {1 + accepted / drafts:.2f}")
        parts.append(f"Draft acceptance rate: {accepted / max(proposed, 1) * 100:.1f}%")
    return ", ".join(parts)


def is_busy(before: SchedulerStats, after: SchedulerStats) -> bool:
    """Whether anything ran in the interval or still waits to."""
    moved = after.prompt_tokens != before.prompt_tokens or after.generation_tokens != before.generation_tokens
    return moved or after.num_running > 0 or after.num_waiting > 0


async def log_stats(read: Callable[[], SchedulerStats], kv_device: str, interval_s: float = DEFAULT_INTERVAL_S) -> None:
    """Every `interval_s` until cancelled: the engine line, at info while busy, else at debug."""
    before = Snapshot(read(), time.monotonic())
    while True:
        await asyncio.sleep(interval_s)
        after = Snapshot(read(), time.monotonic())
        level = logging.INFO if is_busy(before.stats, after.stats) else logging.DEBUG
        logger.log(level, "%s", stats_line(before, after, kv_device))
        before = after
