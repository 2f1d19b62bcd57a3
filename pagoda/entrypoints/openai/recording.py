"""What the server records about each engine request as it runs and ends: Prometheus metrics,
one log line, a row for the web console (its non-prompt fields), and (with --request-log) one
JSON record. Times are the engine's (time.monotonic()
from the request's arrival at the engine); the record's timestamp is wall-clock."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from pagoda.engine.outputs import SequenceOutput
from pagoda.entrypoints.openai.console.feed import RecentRequests
from pagoda.entrypoints.openai.metrics import ServerMetrics
from pagoda.entrypoints.openai.request_log import RequestLogWriter
from pagoda.entrypoints.openai.tracing import RequestTracer
from pagoda.pooling_params import PoolingParams, sequences_of
from pagoda.sampling_params import SamplingParams

logger = logging.getLogger("pagoda.requests")


@dataclass(frozen=True)
class RecordSinks:
    """Where records go; shared by all requests of a server."""

    metrics: ServerMetrics
    request_log: RequestLogWriter | None
    log_prompts: bool
    tokenizer: object
    recent: RecentRequests  # the console's table and percentiles
    max_log_len: int | None = None  # prompt characters the log line and the console show (None: all)
    tracer: RequestTracer | None = None  # --otlp-traces-endpoint's: a span per finished prompt
    log_outputs: bool = False  # the log line has the output text (--enable-log-outputs), cut as prompts are


class RequestRecorder:
    """The Observer of one HTTP request's Generation (see streams.py)."""

    def __init__(
        self,
        sinks: RecordSinks,
        endpoint: str,
        request_ids: list[str],
        prompts: list[list[int]],
        params: SamplingParams | PoolingParams,
        body: dict | None,
        logged: bool = True,
        trace: TraceContext | None = None,
    ) -> None:
        """`logged`: each prompt, once done, has its log line, its console row, its request log
        record and its span (a beam search's steps have none: the search is logged as one);
        `trace`: where its span goes, with --otlp-traces-endpoint."""
        self.sinks = sinks
        self.logged = logged
        self.endpoint = endpoint
        self.request_ids = request_ids  # each prompt's, as the client's answer names it
        self.prompts = prompts
        self.params = params
        self.n = sequences_of(params)
        self.body = body  # the request as sent; kept only when the request log is on
        self.trace = trace
        self._admitted: set[int] = set()
        self._last_tokens: dict[tuple[int, int], float] = {}  # (prompt, sequence): when its last tokens came

    def on_update(self, prompt: int, update: SequenceOutput) -> None:
        metrics = self.sinks.metrics
        now = time.monotonic()
        if prompt not in self._admitted:
            self._admitted.add(prompt)
            metrics.prompt_tokens.inc(update.metrics.num_prompt_tokens)
            metrics.prompt_tokens_cached.inc(update.metrics.num_cached_tokens)
        metrics.generation_tokens.inc(len(update.token_ids_delta))
        if update.token_ids_delta:
            sequence = (prompt, update.index)
            if sequence in self._last_tokens:
                metrics.itl.observe(now - self._last_tokens[sequence])
            else:
                metrics.first_token(update, now)
            self._last_tokens[sequence] = now
        if update.finished:
            metrics.finished(update, update.finish_reason, now)

    def on_prompt_done(self, prompt: int, latest: dict[int, SequenceOutput], aborted: bool) -> None:
        now = time.monotonic()
        if aborted:
            for index in range(self.n):
                out = latest.get(index)
                if out is None:
                    self.sinks.metrics.count_finished("abort")
                elif not out.finished:
                    self.sinks.metrics.finished(out, "abort", now)
        outs = [latest[k] for k in sorted(latest)]
        max_tokens = self.params.max_tokens if isinstance(self.params, SamplingParams) else None
        self.sinks.metrics.prompt_done(outs, self.n, max_tokens)
        if not self.logged:
            return
        reasons = sorted({out.finish_reason or "abort" for out in outs}) or ["abort"]
        summary = _Summary.of(outs, now)
        text = None
        if self.sinks.log_prompts:
            text = self.sinks.tokenizer.decode(self.prompts[prompt])[: self.sinks.max_log_len]
        outputs = [out.text[: self.sinks.max_log_len] for out in outs] if self.sinks.log_outputs else None
        self._log_line(prompt, summary, ",".join(reasons), text, outputs)
        self.sinks.recent.add(self._row(prompt, summary, ",".join(reasons), text), now)
        if self.sinks.request_log is not None:
            self.sinks.request_log.write(self._record(prompt, outs, summary, ",".join(reasons)))
        if self.sinks.tracer is not None and self.trace is not None:
            t = self.trace
            self.sinks.tracer.request_span(t.headers, self.request_ids[prompt], t.model, outs, self.params, now)

    def _log_line(
        self, prompt: int, s: _Summary, reasons: str, prompt_text: str | None, outputs: list[str] | None
    ) -> None:
        text = "" if prompt_text is None else f" prompt={prompt_text!r}"
        if outputs is not None:  # one sequence's text, or the n of them
            text += f" output={outputs[0]!r}" if len(outputs) == 1 else f" outputs={outputs!r}"
        logger.info(
            "%s %s: prompt_tokens=%d cached_tokens=%d output_tokens=%d ttft=%s e2e=%s finish_reason=%s%s",
            self.request_ids[prompt],
            self.endpoint,
            len(self.prompts[prompt]),
            s.cached_tokens,
            s.output_tokens,
            _seconds(s.ttft_s),
            _seconds(s.latency_s),
            reasons,
            text,
        )

    def _row(self, prompt: int, s: _Summary, reasons: str, prompt_text: str | None) -> dict:
        """The request log's non-prompt fields (and the prompt only where lines log it)."""
        return {
            "request_id": self.request_ids[prompt],
            "endpoint": self.endpoint,
            "finished": time.time(),
            "prompt_tokens": len(self.prompts[prompt]),
            "output_tokens": s.output_tokens,
            "cached_tokens": s.cached_tokens,
            "ttft_s": s.ttft_s,
            "tpot_s": s.tpot_s,
            "latency_s": s.latency_s,
            "finish_reason": reasons,
            "prompt": prompt_text,
        }

    def _record(self, prompt: int, outs: list[SequenceOutput], s: _Summary, reasons: str) -> dict:
        return {
            "timestamp": time.time(),
            "endpoint": self.endpoint,
            "request_id": self.request_ids[prompt],
            "body": self.body,
            "prompt_token_ids": self.prompts[prompt],
            "prompt_tokens": len(self.prompts[prompt]),
            "cached_tokens": s.cached_tokens,
            "output_tokens": s.output_tokens,
            "output_token_ids": list(outs[0].token_ids) if outs else [],
            "finish_reason": reasons,
            "ttft_s": s.ttft_s,
            "latency_s": s.latency_s,
        }


@dataclass(frozen=True)
class TraceContext:
    """What a request's spans carry from its HTTP request: the W3C trace headers (their parent)
    and the model that answers it."""

    headers: dict[str, str]
    model: str


@dataclass(frozen=True)
class _Summary:
    cached_tokens: int
    output_tokens: int  # over all n sequences
    ttft_s: float | None  # first token of any sequence
    latency_s: float | None
    tpot_s: float | None  # the first sequence's mean time per token after its first

    @classmethod
    def of(cls, outs: list[SequenceOutput], now: float) -> _Summary:
        if not outs:
            return cls(0, 0, None, None, None)
        arrival = min(out.metrics.arrival_time for out in outs)
        firsts = [out.metrics.first_token_time for out in outs if out.metrics.first_token_time is not None]
        first = outs[0]
        tpot = None
        if first.metrics.first_token_time is not None and len(first.token_ids) > 1:
            tpot = round((now - first.metrics.first_token_time) / (len(first.token_ids) - 1), 6)
        return cls(
            cached_tokens=outs[0].metrics.num_cached_tokens,
            output_tokens=sum(len(out.token_ids) for out in outs),
            ttft_s=round(min(firsts) - arrival, 6) if firsts else None,
            latency_s=round(now - arrival, 6),
            tpot_s=tpot,
        )


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}s"
