"""Metric arithmetic on exact, hand-made records: no server, no timing jitter."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagoda.bench.client import StreamResult
from pagoda.bench.datasets import Prompt
from pagoda.bench.errors import BenchError
from pagoda.bench.metrics import SLO, RequestRecord, percentile, stats, summarize
from pagoda.bench.runner import Exchange, to_record
from pagoda.bench.tokens import LazyTokenizer


def record(
    index: int, ttft: float, itls: list[float], out: int, prompt: int = 10, error: str | None = None
) -> RequestRecord:
    if error:
        return RequestRecord(index, index, 0, 0.0, None, None, (), None, None, "none", error)
    return RequestRecord(index, index, 0, 0.0, ttft, ttft + sum(itls), tuple(itls), prompt, out, "usage")


@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=50), st.sampled_from([0, 1, 50, 95, 99, 100]))
def test_percentile_matches_numpy_linear(values: list[float], q: float) -> None:
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-9, abs=1e-9)


def test_stats_of_known_values() -> None:
    s = stats([0.4, 0.1, 0.3, 0.2])
    assert s is not None
    assert s.mean == pytest.approx(0.25)
    assert s.median == pytest.approx(0.25)
    assert s.p95 == pytest.approx(0.3 + 0.85 * 0.1)  # rank 2.85 between 0.3 and 0.4
    assert s.p99 == pytest.approx(0.3 + 0.97 * 0.1)
    assert stats([]) is None


def test_tpot_excludes_the_first_token() -> None:
    r = record(0, 0.5, [0.1, 0.1, 0.1, 0.1], out=5)
    assert r.latency_s == pytest.approx(0.9)
    assert r.tpot_s == pytest.approx((0.9 - 0.5) / 4)
    assert record(1, 0.5, [], out=1).tpot_s is None


def test_summary_throughputs_latencies_and_errors() -> None:
    records = [
        record(0, 0.1, [0.02, 0.02, 0.02], out=4, prompt=10),
        record(1, 0.3, [0.05], out=2, prompt=20),
        record(2, 0.2, [], out=1, prompt=30),
        record(3, 0, [], 0, error="HTTP 500: boom"),
        record(4, 0, [], 0, error="HTTP 500: boom"),
        record(5, 0, [], 0, error="timeout"),
    ]
    s = summarize(records, duration_s=2.0, slo=None)
    assert (s.completed, s.failed) == (3, 3)
    assert (s.input_tokens, s.output_tokens) == (60, 7)
    assert s.request_throughput == pytest.approx(1.5)
    assert s.output_throughput == pytest.approx(3.5)
    assert s.total_token_throughput == pytest.approx(33.5)
    assert s.ttft.median == pytest.approx(0.2) and s.ttft.mean == pytest.approx(0.2)
    assert s.tpot.mean == pytest.approx((0.02 + 0.05) / 2)  # the one-token request has no TPOT
    assert sorted([0.02, 0.02, 0.02, 0.05]) == sorted(gap for r in records for gap in r.itl_s)
    assert s.itl.median == pytest.approx(0.02)
    assert s.e2e.mean == pytest.approx((0.16 + 0.35 + 0.2) / 3)
    assert s.errors == (("HTTP 500: boom", 2), ("timeout", 1))
    assert s.goodput is None


def test_goodput_counts_requests_meeting_every_slo() -> None:
    records = [
        record(0, 0.1, [0.02, 0.02], out=3),  # good
        record(1, 0.6, [0.02], out=2),  # TTFT too slow
        record(2, 0.1, [0.2], out=2),  # TPOT too slow
        record(3, 0.4, [], out=1),  # one token: TPOT counts as 0, good
    ]
    s = summarize(records, duration_s=4.0, slo=SLO.parse("ttft=500ms,tpot=50ms"))
    assert s.goodput == pytest.approx(2 / 4.0)
    assert summarize(records, 4.0, SLO.parse("e2e=0.35s")).goodput == pytest.approx(2 / 4.0)  # E2E 0.14 and 0.3


def test_slo_parsing() -> None:
    assert SLO.parse("ttft=500ms,tpot=50") == SLO(ttft_s=0.5, tpot_s=0.05)
    assert SLO.parse("e2el=2s") == SLO(e2e_s=2.0)
    for bad in ("ttft", "speed=3ms", "", "ttft=fast"):
        with pytest.raises(BenchError):
            SLO.parse(bad)


def test_zero_duration_gives_zero_throughput() -> None:
    s = summarize([], 0.0, None)
    assert (s.completed, s.request_throughput, s.ttft) == (0, 0.0, None)


def exchange(result: StreamResult) -> Exchange:
    return Exchange(3, 1, 0, Prompt("completions", {"prompt": "x"}, (1, 2, 3)), result, 0.0)


def test_record_from_a_stream_uses_token_chunk_times() -> None:
    result = StreamResult(10.0, (10.25, 10.30, 10.40, 10.45), "a b c d", None, 4, None)
    r = to_record(exchange(result), level_start=9.5, tokenizer=LazyTokenizer(None))
    assert r.start_s == pytest.approx(0.5)
    assert r.ttft_s == pytest.approx(0.25)
    assert r.latency_s == pytest.approx(0.45)
    assert r.itl_s == pytest.approx((0.05, 0.10, 0.05))
    assert r.tpot_s == pytest.approx(0.2 / 3)
    assert (r.prompt_tokens, r.output_tokens, r.token_source) == (3, 4, "usage")  # prompt: the known ids


def test_record_without_usage_or_tokenizer_counts_chunks() -> None:
    result = StreamResult(0.0, (0.1, 0.2), "ab", 7, None, None)
    r = to_record(exchange(result), 0.0, LazyTokenizer(None))
    assert (r.prompt_tokens, r.output_tokens, r.token_source) == (7, 2, "chunks")


def test_failed_stream_becomes_an_error_record() -> None:
    r = to_record(exchange(StreamResult(0.0, (), "", None, None, "HTTP 503: busy")), 0.0, LazyTokenizer(None))
    assert not r.ok and r.error == "HTTP 503: busy" and r.ttft_s is None
