"""One engine's benchmark: optional launch and cold start, warm-up, the concurrency sweep, and
the server-side figures, gathered into an EngineResult that grows as levels finish, so that an
error or Ctrl-C keeps everything measured until then."""

from __future__ import annotations

import asyncio
import os
import random
import shlex
import sys
import time
from collections.abc import Iterable
from contextlib import ExitStack
from dataclasses import dataclass, field

import aiohttp
from tqdm import tqdm

from pagoda.bench.client import Target, list_models, make_client, reset_prefix_cache, stream_request
from pagoda.bench.datasets import (
    Prompt,
    Session,
    Workload,
    describe,
    prefix_share,
    sessions,
    short_name,
    take_requests,
    token_lists,
)
from pagoda.bench.errors import BenchError, NotAnswering
from pagoda.bench.launcher import check_port_free, launched, wait_until_ready
from pagoda.bench.memory import MemoryPeak, MemorySampler
from pagoda.bench.metrics import RequestRecord, Summary, summarize
from pagoda.bench.runner import Exchange, Load, compares_calls, resend_whole, run_level, to_record
from pagoda.bench.server_metrics import PrefixCacheStats, prefix_cache_stats, scrape
from pagoda.bench.settings import BenchSettings
from pagoda.bench.tokens import LazyTokenizer, Tokenizer, resolve_source

PROBE_TOKENS = 8
READY_POLL_S = 1.0  # --ready-check-timeout-sec: between two asks


@dataclass(frozen=True)
class ColdStart:
    ready_s: float  # launch until GET /v1/models answered
    first_request_s: float | None  # launch until a first short request completed; None if it failed
    probe_error: str | None = None


@dataclass(frozen=True)
class LevelResult:
    concurrency: int
    seed_label: str  # the prompts' stream: equal labels and seeds sent equal prompts
    summary: Summary
    prefix_cache: PrefixCacheStats | None
    records: tuple[RequestRecord, ...]
    interrupted: bool = False


@dataclass
class EngineResult:
    """Filled in as the run goes; `status` is "running" until it ends, then "ok", "errors" (some
    requests failed), "failed" (the run stopped on `error`) or "interrupted"."""

    name: str
    base_url: str
    launch_command: str | None = None
    model: str | None = None
    tokenizer: str | None = None
    workload: str = ""
    workload_name: str = ""  # short, for plot titles
    ideal_prefix_share: float | None = None  # the hit rate an unbounded prefix cache would reach
    peak_load_average: float | None = None  # the 1-minute load average, highest seen at a level's end
    in_flight_bound: bool = True  # False: a request rate without --concurrency (its levels bound nothing)
    cold_start: ColdStart | None = None
    memory: MemoryPeak | None = None
    levels: list[LevelResult] = field(default_factory=list)
    status: str = "running"
    error: str | None = None

    @property
    def exit_code(self) -> int:
        return {"ok": 0, "errors": 1, "interrupted": 130}.get(self.status, 2)


def execute(settings: BenchSettings, workload: Workload, name: str) -> EngineResult:
    """Run the benchmark; never raises for the failures a user can cause."""
    result = EngineResult(name, settings.base_url, shlex.join(settings.launch.command) if settings.launch else None)
    result.in_flight_bound = settings.in_flight_bound
    sampler: MemorySampler | None = None
    try:
        with ExitStack() as stack:
            launched_at, ready_s, pid = None, None, settings.server_pid
            if settings.launch:
                check_port_free(settings.base_url)
                launched_at = time.perf_counter()
                process = stack.enter_context(launched(settings.launch))
                pid = process.pid
            sampler = stack.enter_context(MemorySampler(pid))
            if settings.launch:
                _status(f"{name}: waiting for {settings.base_url} (log: {settings.launch.log_path})")
                ready_s = wait_until_ready(process, settings.launch, settings.base_url, launched_at)  # type: ignore[arg-type]
                _status(f"{name}: answering after {ready_s:.1f} s")
            asyncio.run(_bench(settings, workload, result, launched_at, ready_s))
        result.status = "errors" if any(level.summary.failed for level in result.levels) else "ok"
    except BenchError as exc:
        result.status, result.error = "failed", str(exc)
    except KeyboardInterrupt:
        result.status = "interrupted"
    finally:
        if sampler is not None:
            result.memory = sampler.peak()
    return result


async def _bench(
    settings: BenchSettings, workload: Workload, result: EngineResult, launched_at: float | None, ready_s: float | None
) -> None:
    async with make_client(
        max(settings.concurrency) + settings.warmup, settings.request_timeout_s, settings.headers
    ) as http:
        if settings.ready_timeout_s:
            await _wait_until_answering(http, settings)
        target = await _target(http, settings)
        result.model = target.model
        if launched_at is not None and ready_s is not None:
            result.cold_start = await _cold_start(http, target, settings, launched_at, ready_s)
        lazy = LazyTokenizer(resolve_source(settings.tokenizer, target.model))
        tokenizer = lazy.require(f"the {workload.spec.kind} workload") if workload.spec.needs_tokenizer else None
        result.tokenizer = lazy.source
        result.workload_name = short_name(workload.spec)
        result.workload, result.ideal_prefix_share = _statement(settings, workload, tokenizer or lazy.get())
        _status(f"{result.name}: {result.workload}")
        if settings.warmup:
            await _warmup(http, target, settings, workload, tokenizer)
        resets = settings.reset_prefix_cache
        for index, concurrency in enumerate(settings.concurrency):
            if resets:
                resets = await _reset_prefix_cache(http, settings)
            await _level(http, target, settings, workload, lazy, result, index, concurrency)
            result.peak_load_average = max(result.peak_load_average or 0.0, _load_average())


async def _wait_until_answering(http: aiohttp.ClientSession, settings: BenchSettings) -> None:
    """vLLM's --ready-check-timeout-sec: asks GET /v1/models until the server answers it (a server
    still starting refuses the connection or answers 503), at most that long; a refused key is
    final at once."""
    deadline = time.monotonic() + settings.ready_timeout_s
    _status(f"waiting up to {settings.ready_timeout_s:g} s for {settings.base_url}")
    while True:
        try:
            await list_models(http, settings.base_url, settings.api_key)
            return
        except NotAnswering:
            if time.monotonic() >= deadline:
                raise
            await asyncio.sleep(READY_POLL_S)


async def _target(http: aiohttp.ClientSession, settings: BenchSettings) -> Target:
    models = await list_models(http, settings.base_url, settings.api_key)
    model = settings.model or (models[0] if models else None)
    if model is None:
        listed = "lists no model" if models is not None else "gives no model list (no such route, or not a list)"
        raise BenchError(f"{settings.base_url}/v1/models {listed}; pass --model")
    if models and model not in models:
        raise BenchError(f"{settings.base_url} does not serve the model {model!r}; it serves {', '.join(models)}")
    return Target(
        settings.base_url,
        model,
        settings.api_key,
        settings.request_timeout_s,
        settings.temperature,
        settings.ignore_eos,
        settings.extra_body,
    )


async def _cold_start(
    http: aiohttp.ClientSession, target: Target, settings: BenchSettings, launched_at: float, ready_s: float
) -> ColdStart:
    """Time until a first short request completes: servers that compile, capture graphs or
    allocate lazily pay it here, not in the measured levels."""
    text = "Hello! Please introduce yourself."
    body = (
        {"messages": [{"role": "user", "content": text}]} if settings.workload.endpoint == "chat" else {"prompt": text}
    )
    probe = await stream_request(http, target, Prompt(settings.workload.endpoint, body | {"max_tokens": PROBE_TOKENS}))
    if probe.error:
        _status(f"warning: the first request after launch failed: {probe.error}")
        return ColdStart(ready_s, None, probe.error)
    return ColdStart(ready_s, time.perf_counter() - launched_at)


def _statement(settings: BenchSettings, workload: Workload, tokenizer: Tokenizer | None) -> tuple[str, float | None]:
    """The workload in words, with the prefix share of a level's prompts when their tokens are
    known; and that share."""
    text = describe(workload.spec)
    if workload.spec.kind == "multi-turn":
        return text, None
    count = workload.requests_per_level(settings.num_prompts) or workload.spec.default_num_prompts() or 0
    lists = token_lists(sessions(workload, tokenizer, settings.seed, "level0"), count, tokenizer)
    if not lists:
        return text, None
    shared, total = prefix_share(lists)
    statement = (
        f"{text}; {shared / total:.1%} of the prompt tokens of a level's first {len(lists)} requests "
        "repeat a prefix of an earlier request (the hit rate of an unbounded prefix cache)"
    )
    return statement, shared / total


async def _reset_prefix_cache(http: aiohttp.ClientSession, settings: BenchSettings) -> bool:
    """Reset the server's prefix cache; False (after a warning) when the server has no way to."""
    if await reset_prefix_cache(http, settings.base_url, settings.api_key):
        return True
    _status(f"warning: {settings.base_url} has no /reset_prefix_cache (404); its prefix cache is not reset")
    return False


def _load_average() -> float:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0


async def _warmup(
    http: aiohttp.ClientSession,
    target: Target,
    settings: BenchSettings,
    workload: Workload,
    tokenizer: Tokenizer | None,
) -> None:
    """Requests of the same workload under their own seed label, not counted. All of them
    failing means the benchmark would measure nothing: stop with the server's message."""
    exchanges: list[Exchange] = []
    stream = take_requests(sessions(workload, tokenizer, settings.seed, "warmup"), settings.warmup)
    await run_level(http, target, stream, Load(settings.warmup), random.Random(0), exchanges)
    errors = [x.result.error for x in exchanges if x.result.error]
    if errors and len(errors) == len(exchanges):
        raise BenchError(f"all {len(errors)} warm-up requests failed, e.g.: {errors[0]}")
    if errors:
        _status(f"warning: {len(errors)} of {len(exchanges)} warm-up requests failed, e.g.: {errors[0]}")


async def _level(
    http: aiohttp.ClientSession,
    target: Target,
    settings: BenchSettings,
    workload: Workload,
    lazy: LazyTokenizer,
    result: EngineResult,
    index: int,
    concurrency: int,
) -> None:
    label = f"level{index}"
    stream: Iterable[Session] = sessions(
        workload, lazy.get() if workload.spec.needs_tokenizer else None, settings.seed, label
    )
    if settings.num_prompts:
        # Built before the clock starts: tokenizing inside the level would stall the event loop
        # and add its time to the measured latencies.
        stream = list(take_requests(stream, settings.num_prompts))
    load = Load(concurrency, settings.request_rate, settings.burstiness, settings.duration_s)
    before = await scrape(http, settings.metrics_url) if settings.metrics_url else None
    exchanges: list[Exchange] = []
    bar = tqdm(
        total=workload.requests_per_level(settings.num_prompts),
        desc=f"concurrency {concurrency}",
        unit="req",
        disable=not settings.progress,
        file=sys.stderr,
        leave=False,
    )
    start = time.perf_counter()
    try:
        start = await run_level(
            http, target, stream, load, random.Random(f"{settings.seed}:{label}:arrivals"), exchanges, bar.update
        )
    except asyncio.CancelledError:
        result.levels.append(_level_result(concurrency, label, exchanges, start, lazy, settings, None, True))
        raise
    finally:
        bar.close()
    after = await scrape(http, settings.metrics_url) if settings.metrics_url and before is not None else None
    prefix = prefix_cache_stats(before, after) if before is not None and after is not None else None
    try:
        exchanges = await _resend_unstreamed(http, target, exchanges, concurrency, result.name)
    finally:  # Ctrl-C during the re-sends keeps the level, its calls not compared
        level = _level_result(concurrency, label, exchanges, start, lazy, settings, prefix, False)
        result.levels.append(level)
    _status(f"{result.name}: {_one_line(level, result.in_flight_bound)}")


async def _resend_unstreamed(
    http: aiohttp.ClientSession, target: Target, exchanges: list[Exchange], concurrency: int, name: str
) -> list[Exchange]:
    """The level's exchanges, those whose tool calls are compared with their non-streamed answer
    attached. Sent after the level's clock stopped and its server metrics were read, so that
    they count in no figure of the level."""
    count = sum(compares_calls(x, target) for x in exchanges)
    if not count:
        return exchanges
    _status(f"{name}: sending {count} requests again without streaming, to compare their tool calls")
    return await resend_whole(http, target, exchanges, concurrency)


def _level_result(
    concurrency: int,
    label: str,
    exchanges: list[Exchange],
    start: float,
    lazy: LazyTokenizer,
    settings: BenchSettings,
    prefix: PrefixCacheStats | None,
    interrupted: bool,
) -> LevelResult:
    keep_text = settings.vllm_results is not None and settings.vllm_results.detailed
    records = tuple(sorted((to_record(x, start, lazy, keep_text) for x in exchanges), key=lambda r: r.index))
    duration = max((x.finished_at for x in exchanges), default=start) - start
    return LevelResult(concurrency, label, summarize(records, duration, settings.slo), prefix, records, interrupted)


def _one_line(level: LevelResult, in_flight_bound: bool) -> str:
    s = level.summary
    ttft = f"{s.ttft.median * 1000:.0f} ms" if s.ttft else "-"
    bound = f"concurrency {level.concurrency}" if in_flight_bound else "no concurrency bound"
    line = (
        f"{bound}: {s.completed} ok, {s.failed} failed in {s.duration_s:.1f} s; "
        f"{s.output_throughput:.1f} output tok/s; TTFT p50 {ttft}"
    )
    if s.schema_valid_rate is not None:
        line += f"; {s.schema_valid_rate:.1%} structured outputs valid"
    if s.tool_calls_valid_rate is not None:
        line += f"; {s.tool_calls_valid_rate:.1%} tool calls valid"
    if s.tool_calls_agree_rate is not None:
        line += f"; {s.tool_calls_agree_rate:.1%} streamed = non-streamed calls"
    if s.errors:
        line += "; errors: " + "; ".join(f"{message} (x{count})" for message, count in s.errors)
    return line


def _status(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
