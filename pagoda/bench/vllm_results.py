"""vLLM's result JSON (`vllm bench serve --save-result`), one file a concurrency level, so that
scripts and dashboards that read vLLM's results read `pagoda bench`'s: its flat fields (date,
backend, model_id, num_prompts, request_rate, max_concurrency, duration, completed, failed,
total_input_tokens, .., request_throughput, output_throughput, ..), times in milliseconds as
mean_/median_/std_/pNN_<metric>_ms for --percentile-metrics at --metric-percentiles,
max_output_tokens_per_s and max_concurrent_requests as vLLM counts them (per one-second bucket of
the level), and with --save-detailed the per-request lists. Named as vLLM names the file, unless
--result-filename names it."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from pagoda.bench.metrics import RequestRecord, percentile
from pagoda.bench.run import EngineResult, LevelResult
from pagoda.bench.settings import BenchSettings, VllmResults


def write_vllm_results(settings: BenchSettings, result: EngineResult, when: datetime) -> list[Path]:
    """Each level's vLLM result JSON, written (or with --append-result, added as a line); the paths."""
    spec = settings.vllm_results
    assert spec is not None, "only with --save-result"
    spec.folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for level in result.levels:
        path = spec.folder / _file_name(spec, settings, result, level, when)
        data = vllm_result(settings, result, level, when)
        with path.open("a" if spec.append else "w", encoding="utf-8") as handle:
            if spec.append and handle.tell():
                handle.write("\n")
            json.dump(data, handle)
        paths.append(path)
    return paths


def vllm_result(settings: BenchSettings, result: EngineResult, level: LevelResult, when: datetime) -> dict[str, Any]:
    spec = settings.vllm_results
    assert spec is not None
    s = level.summary
    done = [r for r in level.records if r.ok]
    data: dict[str, Any] = {
        "date": when.strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": spec.backend,
        "backend": spec.backend,
        "label": spec.label,
        "model_id": result.model,
        "tokenizer_id": result.tokenizer,
        "num_prompts": len(level.records),
        **dict(spec.metadata),
        "request_rate": settings.request_rate if math.isfinite(settings.request_rate) else "inf",
        "burstiness": settings.burstiness,
        "max_concurrency": _max_concurrency(settings, level),
        "duration": s.duration_s,
        "completed": s.completed,
        "failed": s.failed,
        "total_input_tokens": s.input_tokens,
        "total_output_tokens": s.output_tokens,
        "request_throughput": s.request_throughput,
        "request_goodput": s.goodput,
        "output_throughput": s.output_throughput,
        "total_token_throughput": s.total_token_throughput,
        **_peaks(done),
        "latencies": [r.latency_s for r in done],  # vLLM keeps this list without --save-detailed too
    }
    samples = {
        "ttft": [r.ttft_s for r in done],
        "tpot": [r.tpot_s for r in done if r.tpot_s is not None],
        "itl": [gap for r in done for gap in r.itl_s],
        "e2el": [r.latency_s for r in done],
    }
    for metric in spec.percentile_metrics:
        data |= _stats_ms(metric, samples[metric], spec.percentiles)  # type: ignore[arg-type]
    if spec.detailed:
        data |= {
            "input_lens": [r.prompt_tokens for r in level.records],
            "output_lens": [r.output_tokens or 0 for r in level.records],
            "ttfts": [r.ttft_s or 0.0 for r in level.records],
            "itls": [list(r.itl_s) for r in level.records],
            "start_times": [r.start_s for r in level.records],
            "generated_texts": [r.output_text or "" for r in level.records],
            "errors": [r.error or "" for r in level.records],
        }
    return data


def _max_concurrency(settings: BenchSettings, level: LevelResult) -> int | None:
    """The level's bound on requests in flight; None where there was none (a request rate alone)."""
    return level.concurrency if settings.in_flight_bound else None


def _stats_ms(metric: str, values: Sequence[float], percentiles: Sequence[float]) -> dict[str, float]:
    """vLLM's statistics of a metric in milliseconds (0 where no request had it, as vLLM's)."""
    ms = [v * 1000 for v in values] or [0.0]
    mean = sum(ms) / len(ms)
    stats = {
        f"mean_{metric}_ms": mean,
        f"median_{metric}_ms": percentile(ms, 50),
        f"std_{metric}_ms": math.sqrt(sum((v - mean) ** 2 for v in ms) / len(ms)),
    }
    for p in percentiles:
        stats[f"p{int(p) if int(p) == p else p}_{metric}_ms"] = percentile(ms, p)
    return stats


def _peaks(done: Sequence[RequestRecord]) -> dict[str, float | int]:
    """vLLM's peaks: the most tokens that arrived within one second-long bucket from the first send,
    and the most requests that were in flight at some time in one bucket."""
    if not done:
        return {"max_output_tokens_per_s": 0.0, "max_concurrent_requests": 0}
    first = min(r.start_s for r in done)
    buckets = math.ceil(max(r.start_s + r.latency_s for r in done) - first) + 1  # type: ignore[operator]
    tokens, requests = [0] * buckets, [0] * buckets
    for r in done:
        arrival = r.start_s + r.ttft_s  # type: ignore[operator]
        for gap in (0.0, *r.itl_s):
            arrival += gap
            if 0 <= int(arrival - first) < buckets:
                tokens[int(arrival - first)] += 1
        for second in range(int(r.start_s - first), int(r.start_s + r.latency_s - first) + 1):  # type: ignore[operator]
            requests[second] += 1
    return {"max_output_tokens_per_s": float(max(tokens)), "max_concurrent_requests": max(requests)}


def _file_name(
    spec: VllmResults, settings: BenchSettings, result: EngineResult, level: LevelResult, when: datetime
) -> str:
    """--result-filename (with -cN before its suffix where the run has several levels), else vLLM's
    LABEL-RATEqps[-concurrencyN]-MODEL-DATE.json."""
    if spec.filename is not None:
        if len(result.levels) == 1:
            return spec.filename
        path = Path(spec.filename)
        return f"{path.stem}-c{level.concurrency}{path.suffix}"
    bound = _max_concurrency(settings, level)
    concurrency = f"-concurrency{bound}" if bound is not None else ""
    model = (result.model or "model").split("/")[-1]
    rate = float(settings.request_rate)
    return f"{spec.label or spec.backend}-{rate}qps{concurrency}-{model}-{when.strftime('%Y%m%d-%H%M%S')}.json"
