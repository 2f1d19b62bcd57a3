"""Benchmark arithmetic, with vLLM's definitions; pure functions over finished requests.

- TTFT: from sending the request to the first chunk that carries generated text.
- ITL: the gaps between consecutive chunks that carry generated text.
- E2E latency: from sending the request to its last chunk carrying generated text
  (vLLM's end; the usage chunk and [DONE] follow at once), so E2E = TTFT + sum(ITL).
- TPOT: (E2E - TTFT) / (output tokens - 1), so the first token is excluded; requests of one
  output token have none.
- Throughputs divide by the level's duration: from its first send to its last completion.
- Goodput: requests per second that met every SLO given (a one-token request counts TPOT 0).
- Structured outputs valid: of the completed requests that asked for a JSON schema, the share
  whose answer parsed and matched it; failed requests are not graded (they count in `failed`).
- Tool calls valid: of the completed requests that had to call a tool, the share whose calls all
  named an offered tool with arguments valid against its parameters (and there was one).
- Streamed = non-streamed calls: of the completed requests sent again without streaming, the
  share whose two answers had the same calls (a failed re-send counts as a difference).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from pagoda.bench.errors import BenchError

ERROR_SAMPLES = 5
_SLO_ITEM = re.compile(r"^(ttft|tpot|e2el|e2e)=([0-9.]+)(ms|s)?$")


@dataclass(frozen=True)
class RequestRecord:
    index: int  # dispatch order within its level
    session: int
    turn: int
    start_s: float  # send time, from the level's start
    ttft_s: float | None  # None when the request failed
    latency_s: float | None
    itl_s: tuple[float, ...]
    prompt_tokens: int | None
    output_tokens: int | None
    token_source: str  # where output_tokens came from: "usage", "tokenizer" or "chunks"
    error: str | None = None
    schema_valid: bool | None = None  # None: no schema asked, or the request failed
    schema_error: str | None = None  # why the answer did not parse or match its schema
    tool_calls_valid: bool | None = None  # None: no call expected, or the request failed
    tool_calls_error: str | None = None  # why the calls are missing or invalid
    tool_calls_agree: bool | None = None  # None: not sent again without streaming
    tool_calls_difference: str | None = None  # how the non-streamed answer's calls differ
    output_text: str | None = None  # the answer's text, kept only for --save-detailed (vLLM's generated_texts)

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.latency_s is None or not self.output_tokens or self.output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass(frozen=True)
class Stats:
    """Seconds."""

    mean: float
    median: float
    p95: float
    p99: float


@dataclass(frozen=True)
class SLO:
    """Seconds; None means not checked."""

    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None

    @classmethod
    def parse(cls, text: str) -> SLO:
        """ "ttft=500ms,tpot=50ms,e2e=2s"; a bare number is milliseconds, as in vLLM."""
        values: dict[str, float] = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            match = _SLO_ITEM.match(item)
            if not match:
                raise BenchError(f"bad SLO {item!r}: use ttft=500ms,tpot=50ms,e2e=2s")
            name, number, unit = match.groups()
            values[{"e2el": "e2e"}.get(name, name) + "_s"] = float(number) / (1 if unit == "s" else 1000)
        if not values:
            raise BenchError(f"bad SLO {text!r}: name at least one of ttft, tpot, e2e")
        return cls(**values)

    def met_by(self, record: RequestRecord) -> bool:
        assert record.ttft_s is not None and record.latency_s is not None
        checks = ((self.ttft_s, record.ttft_s), (self.tpot_s, record.tpot_s or 0.0), (self.e2e_s, record.latency_s))
        return all(limit is None or value <= limit for limit, value in checks)


@dataclass(frozen=True)
class Summary:
    completed: int
    failed: int
    duration_s: float
    input_tokens: int
    output_tokens: int
    request_throughput: float  # completed requests per second
    output_throughput: float  # tokens per second
    total_token_throughput: float  # prompt and output tokens per second
    ttft: Stats | None
    tpot: Stats | None
    itl: Stats | None
    e2e: Stats | None
    goodput: float | None  # requests per second that met the SLO; None without one
    schema_valid_rate: float | None  # None when no completed request asked for a schema
    tool_calls_valid_rate: float | None  # None when no completed request had to call a tool
    tool_calls_agree_rate: float | None  # None when no request was sent again without streaming
    errors: tuple[tuple[str, int], ...]  # the most frequent messages with their counts


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default method)."""
    ordered = sorted(values)
    rank = q / 100 * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def stats(values: Sequence[float]) -> Stats | None:
    if not values:
        return None
    return Stats(sum(values) / len(values), percentile(values, 50), percentile(values, 95), percentile(values, 99))


def summarize(records: Sequence[RequestRecord], duration_s: float, slo: SLO | None) -> Summary:
    done = [r for r in records if r.ok]
    input_tokens = sum(r.prompt_tokens or 0 for r in done)
    output_tokens = sum(r.output_tokens or 0 for r in done)
    per_second = 1 / duration_s if duration_s > 0 else 0.0
    tpots = [t for t in (r.tpot_s for r in done) if t is not None]
    errors = Counter(r.error for r in records if not r.ok)
    return Summary(
        completed=len(done),
        failed=len(records) - len(done),
        duration_s=duration_s,
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        request_throughput=len(done) * per_second,
        output_throughput=output_tokens * per_second,
        total_token_throughput=(input_tokens + output_tokens) * per_second,
        ttft=stats([r.ttft_s for r in done]),  # type: ignore[misc]
        tpot=stats(tpots),
        itl=stats([gap for r in done for gap in r.itl_s]),
        e2e=stats([r.latency_s for r in done]),  # type: ignore[misc]
        goodput=None if slo is None else sum(slo.met_by(r) for r in done) * per_second,
        schema_valid_rate=_share([r.schema_valid for r in done]),
        tool_calls_valid_rate=_share([r.tool_calls_valid for r in done]),
        tool_calls_agree_rate=_share([r.tool_calls_agree for r in done]),
        errors=tuple(errors.most_common(ERROR_SAMPLES)),  # type: ignore[arg-type]
    )


def _share(verdicts: Sequence[bool | None]) -> float | None:
    """The share of True among the verdicts given; None when none was."""
    given = [v for v in verdicts if v is not None]
    return sum(given) / len(given) if given else None
