"""`pagoda bench` end to end against the stub server, whose delays and token counts are known.

Timing bounds are one-sided where the stub guarantees them (it never sends a token early) and
generous above (SLACK), because these tests share a 2-core machine with other work.
"""

from __future__ import annotations

import math
import random
import time
from pathlib import Path

import httpx
import pytest
from bench_helpers import read_results, run_bench, write_jsonl

from pagoda.bench import cli
from pagoda.bench.metrics import stats
from pagoda.bench.report import csv_rows
from pagoda.bench.runner import arrival_gap

SLACK = 0.5  # seconds a loaded machine (other tests, other processes) may add to an injected delay
EARLY = 0.002  # clock granularity: nothing arrives earlier than injected by more than this


def bench(stub_url: str, out: Path, *args: str) -> int:
    return cli.main(["--base-url", stub_url, "--no-progress", "--output", str(out), "--warmup", "0", *args])


def directive_file(path: Path, delays: list[float], itl: float, tokens: int, chat: bool, extra: str = "") -> Path:
    rows = []
    for ttft in delays:
        text = f"ttft={ttft} itl={itl} tokens={tokens} w w w {extra}".strip()
        rows.append({"messages": [{"role": "user", "content": text}]} if chat else {"prompt": text, "max_tokens": 50})
    return write_jsonl(path, rows)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_metrics_match_the_injected_delays(start_stub, tmp_path: Path, endpoint: str) -> None:
    stub = start_stub("--hit-percent", "50")
    delays, itl, tokens = [0.1, 0.2, 0.6, 0.8], 0.03, 6
    data = directive_file(tmp_path / "d.jsonl", delays, itl, tokens, chat=endpoint == "chat")
    result = run_bench(
        stub.base_url, "--dataset", str(data), "--endpoint", endpoint, "--concurrency", "4", "--slo", "ttft=400ms"
    )
    assert result.status == "ok"
    level = result.levels[0]
    records, summary = level.records, level.summary
    words = len(f"ttft=0.1 itl={itl} tokens={tokens} w w w".split())
    for injected, r in zip(delays, records):
        assert injected - EARLY <= r.ttft_s <= injected + SLACK  # the chat role chunk is not a token
        assert r.latency_s >= injected + (tokens - 1) * itl - EARLY
        assert r.latency_s == pytest.approx(r.ttft_s + sum(r.itl_s))
        assert len(r.itl_s) == tokens - 1
        assert r.tpot_s == pytest.approx((r.latency_s - r.ttft_s) / (tokens - 1))
        assert (r.output_tokens, r.prompt_tokens, r.token_source) == (tokens, words, "usage")
    all_itl = [gap for r in records for gap in r.itl_s]
    assert itl - EARLY <= sum(all_itl) / len(all_itl) <= itl + SLACK / 4
    assert summary.ttft == stats([r.ttft_s for r in records])
    assert summary.itl == stats(all_itl)
    assert 0.4 - EARLY <= summary.ttft.median <= 0.4 + SLACK  # median of 0.2 and 0.6
    duration = summary.duration_s
    assert max(delays) + (tokens - 1) * itl - EARLY <= duration <= max(delays) + (tokens - 1) * itl + SLACK
    assert (summary.completed, summary.failed) == (4, 0)
    assert summary.request_throughput == pytest.approx(4 / duration)
    assert summary.output_throughput == pytest.approx(4 * tokens / duration)
    assert summary.total_token_throughput == pytest.approx(4 * (tokens + words) / duration)
    assert summary.goodput == pytest.approx(sum(r.ttft_s <= 0.4 for r in records) / duration)
    assert records[2].ttft_s > 0.4 and records[3].ttft_s > 0.4  # injected 0.6 and 0.8 never meet it
    assert level.prefix_cache.hit_rate == pytest.approx((words * 50 // 100) / words)
    assert level.prefix_cache.source == "pagoda counters"


def test_errors_are_counted_with_samples_and_results_kept(start_stub, tmp_path: Path, capsys) -> None:
    stub = start_stub()
    rows = [
        {"prompt": "ok one", "max_tokens": 3},
        {"prompt": "fail"},
        {"prompt": "ok two", "max_tokens": 3},
        {"prompt": "fail again"},
        {"prompt": "cut here", "max_tokens": 3},
    ]
    data = write_jsonl(tmp_path / "e.jsonl", rows)
    assert bench(stub.base_url, tmp_path, "--dataset", str(data)) == 1
    summary = read_results(tmp_path)["engines"][0]["levels"][0]["summary"]
    assert (summary["completed"], summary["failed"]) == (2, 3)
    messages = dict(summary["errors"])
    assert messages["HTTP 500: injected failure"] == 2
    assert any(m.startswith("ClientPayloadError: Response payload is not completed") for m in messages)  # the cut
    assert "3 requests failed" in capsys.readouterr().err
    assert (tmp_path / "results.csv").read_text().count("\n") == 2


def test_random_workload_without_usage_counts_with_the_tokenizer(start_stub, tokenizer) -> None:
    stub = start_stub("--no-usage", "--ttft", "0.01", "--itl", "0.005")
    result = run_bench(
        stub.base_url,
        "--tokenizer",
        "default",
        "--input-len",
        "16",
        "--output-len",
        "4",
        "--num-prompts",
        "3",
        "--seed",
        "7",
    )
    records = result.levels[0].records
    expected = len(tokenizer.encode("tok0 tok1 tok2 tok3 "))
    assert [(r.output_tokens, r.token_source) for r in records] == [(expected, "tokenizer")] * 3
    assert all(r.prompt_tokens == 16 for r in records)  # the generated prompt's own ids
    sent = httpx.get(f"{stub.base_url}/stub/requests").json()
    assert all(b["stream"] and b["stream_options"] == {"include_usage": True} for b in sent)
    assert all(
        b["model"] == "stub-model" and b["max_tokens"] == 4 and b["ignore_eos"] and b["temperature"] == 0 for b in sent
    )


def test_multi_turn_sends_the_history_after_the_think_time(start_stub) -> None:
    stub = start_stub("--ttft", "0.01", "--itl", "0.005")
    result = run_bench(
        stub.base_url,
        "--workload",
        "multi-turn",
        "--endpoint",
        "chat",
        "--tokenizer",
        "default",
        "--turns",
        "3",
        "--think-time",
        "0.2",
        "--num-prompts",
        "6",
        "--concurrency",
        "2",
        "--input-len",
        "8",
        "--output-len",
        "3",
    )
    records = result.levels[0].records
    assert sorted((r.session, r.turn) for r in records) == [(s, t) for s in (0, 1) for t in (0, 1, 2)]
    for session in (0, 1):
        turns = sorted((r for r in records if r.session == session), key=lambda r: r.turn)
        for earlier, later in zip(turns, turns[1:]):
            assert later.start_s >= earlier.start_s + earlier.latency_s + 0.2 - EARLY
            assert later.prompt_tokens > earlier.prompt_tokens  # the history grows
    sent = httpx.get(f"{stub.base_url}/stub/requests").json()
    third_turns = [b["messages"] for b in sent if len(b["messages"]) == 5]
    assert len(third_turns) == 2
    assert all(m[1] == {"role": "assistant", "content": "tok0 tok1 tok2 "} for m in third_turns)


@pytest.mark.parametrize(
    "style, source, rate",
    [("vllm", "vllm counters", 0.25), ("sglang", "sglang gauge after the run", 0.25), ("none", None, None)],
)
def test_prefix_cache_rate_from_each_servers_metrics(start_stub, tmp_path: Path, style, source, rate) -> None:
    stub = start_stub("--metrics-style", style, "--hit-percent", "25", "--ttft", "0.01", "--itl", "0.001")
    data = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a b c d", "max_tokens": 2}] * 2)
    prefix = run_bench(stub.base_url, "--dataset", str(data)).levels[0].prefix_cache
    assert (prefix and prefix.source, prefix and prefix.hit_rate) == (source, rate)


def test_arrival_gaps_have_the_asked_rate_and_burstiness() -> None:
    rng = random.Random(1)
    poisson = [arrival_gap(rng, 20.0, 1.0) for _ in range(20000)]
    bursty = [arrival_gap(rng, 20.0, 0.25) for _ in range(20000)]
    for gaps, cv2 in ((poisson, 1.0), (bursty, 4.0)):
        mean = sum(gaps) / len(gaps)
        variance = sum((g - mean) ** 2 for g in gaps) / len(gaps)
        assert mean == pytest.approx(0.05, rel=0.05)
        assert variance / mean**2 == pytest.approx(cv2, rel=0.15)  # gamma: CV^2 = 1 / shape
    assert arrival_gap(rng, math.inf, 1.0) == 0.0


def test_request_rate_with_a_duration(start_stub, capsys) -> None:
    stub = start_stub("--ttft", "0.01", "--itl", "0.001")
    args = ("--tokenizer", "default", "--input-len", "4", "--output-len", "2")
    args += ("--request-rate", "20", "--duration", "1")
    result = run_bench(stub.base_url, *args, "--concurrency", "50")
    records = result.levels[0].records
    rng, t, expected = random.Random("0:level0:arrivals"), 0.0, 0
    while t < 1.0:  # the seeded arrival times that fall inside the duration
        expected, t = expected + 1, t + arrival_gap(rng, 20.0, 1.0)
    # Exactly those: none due later starts, and every one due within starts however late the client
    # wakes for it (no slot is ever waited for at this concurrency).
    assert len(records) == expected
    assert all(r.start_s < 1.0 + SLACK for r in records)
    unbounded = run_bench(stub.base_url, *args)  # no --concurrency: the level bounds nothing in flight
    assert not unbounded.in_flight_bound and csv_rows([unbounded])[0]["concurrency"] == ""
    assert "no concurrency bound: " in capsys.readouterr().err


def test_closed_loop_with_a_duration_stops_when_a_slot_frees_past_it(start_stub) -> None:
    stub = start_stub("--ttft", "0.2", "--itl", "0.001")
    args = ("--tokenizer", "default", "--input-len", "4", "--output-len", "2", "--concurrency", "2")
    result = run_bench(stub.base_url, *args, "--duration", "1")
    records = result.levels[0].records
    # two slots, each freed about every 0.2 s: about ten requests, none started after the duration
    assert 4 <= len(records) <= 12
    assert all(r.start_s < 1.0 + SLACK for r in records)


def test_request_timeout_ends_a_stalled_request(start_stub, tmp_path: Path) -> None:
    stub = start_stub()
    data = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "ttft=5", "max_tokens": 2}])
    began = time.monotonic()
    result = run_bench(stub.base_url, "--dataset", str(data), "--request-timeout", "0.5")
    assert time.monotonic() - began < 4
    assert result.exit_code == 1
    assert result.levels[0].summary.errors == (("no complete answer within 0.5 s", 1),)


def test_warmup_that_all_fails_stops_with_the_servers_message(start_stub, tmp_path: Path, capsys) -> None:
    stub = start_stub()
    data = write_jsonl(tmp_path / "f.jsonl", [{"prompt": "fail"}] * 3)
    assert cli.main(["--base-url", stub.base_url, "--no-progress", "--dataset", str(data), "--warmup", "2"]) == 2
    assert "all 2 warm-up requests failed, e.g.: HTTP 500: injected failure" in capsys.readouterr().err


def test_terminal_table_shows_every_level(start_stub, tmp_path: Path, capsys) -> None:
    stub = start_stub("--ttft", "0.01", "--itl", "0.001")
    data = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a", "max_tokens": 2}] * 2)
    assert bench(stub.base_url, tmp_path, "--dataset", str(data), "--concurrency", "1,2") == 0
    out = capsys.readouterr().out
    assert "c=1" in out and "c=2" in out and "TTFT p99 (ms)" in out and "output tokens/s" in out
    csv_lines = (tmp_path / "results.csv").read_text().splitlines()
    assert csv_lines[0].startswith("engine,concurrency,interrupted,completed,failed")
    assert [line.split(",")[1] for line in csv_lines[1:]] == ["1", "2"]
