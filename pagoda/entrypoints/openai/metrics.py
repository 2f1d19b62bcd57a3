"""Prometheus metrics with vLLM's names and meanings under a `pagoda:` prefix (`vllm:` with
--metrics-prefix vllm, for dashboards and autoscalers built for vLLM), in a registry of the app's
own (never prometheus_client's global one, so several apps can live in one process).

Engine state (running, waiting, KV usage, prefix-cache counters, preemptions) is read from the
engine's latest SchedulerStats at scrape time; request counters and latency histograms are updated
by the request handlers as sequences finish. One sequence (one of n) counts as one request.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from pagoda.core.outputs import STEP_TOKEN_BOUNDS, SchedulerStats
from pagoda.engine.outputs import SequenceOutput

# vLLM's buckets, so dashboards built for it read the same
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
TPOT_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
FINISH_REASONS = ("stop", "length", "abort")  # the engine's (a tool call finishes as "stop" there)
N_BUCKETS = (1, 2, 5, 10, 20)  # vLLM's, for request_params_n
PREEMPTION_BUCKETS = (1, 2, 3, 4, 5, 10, 20)  # vLLM's, for request_num_preemptions


def token_buckets(max_model_len: int) -> tuple[int, ...]:
    """vLLM's buckets for token counts: 1, 2, 5, 10, 20, 50, .. up to the context length."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_model_len:
                return tuple(buckets)
            buckets.append(mantissa * scale)
        scale *= 10


class _EngineStatsCollector(Collector):
    def __init__(
        self, stats: Callable[[], SchedulerStats], model_name: str, lora_slots: Callable[[], int] | None, prefix: str
    ) -> None:
        self.stats = stats
        self.model_name = model_name
        self.lora_slots = lora_slots
        self.prefix = prefix

    def collect(self) -> Iterator:
        s = self.stats()
        gauges = [
            ("num_requests_running", "Sequences in the running batch.", s.num_running),
            ("num_requests_waiting", "Sequences waiting to be scheduled.", s.num_waiting),
            (
                "kv_cache_usage_perc",
                "Fraction of KV blocks held by requests (idle cached blocks count as free), 0..1.",
                s.kv_usage,
            ),
            ("prefix_cache_blocks", "KV blocks held by the prefix cache.", s.prefix_cache_blocks),
        ]
        counters = [
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_cache_queries),
            ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_cache_hits),
            ("num_preemptions", "Preemptions of running sequences.", s.num_preemptions),
            (
                "spec_decode_num_drafts",
                "Speculative decoding: requests that verified drafts in a step.",
                s.spec_num_drafts,
            ),
            ("spec_decode_num_draft_tokens", "Speculative decoding: draft tokens proposed.", s.spec_num_draft_tokens),
            (
                "spec_decode_num_accepted_tokens",
                "Speculative decoding: draft tokens accepted.",
                s.spec_num_accepted_tokens,
            ),
        ]
        for name, help_, value in gauges:
            family = GaugeMetricFamily(f"{self.prefix}:{name}", help_, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family
        for name, help_, value in counters:
            family = CounterMetricFamily(f"{self.prefix}:{name}", help_, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family
        # vLLM's name, _total and all, for a histogram (its series: iteration_tokens_total_bucket, ..)
        family = HistogramMetricFamily(
            f"{self.prefix}:iteration_tokens_total",
            "Tokens per engine step: prompt tokens computed plus tokens sampled.",
            labels=["model_name"],
        )
        cumulative = itertools.accumulate(s.step_token_counts)
        buckets = [(str(float(bound)), count) for bound, count in zip(STEP_TOKEN_BOUNDS, cumulative)]
        family.add_metric(
            [self.model_name],
            buckets + [("+Inf", sum(s.step_token_counts))],
            s.prompt_tokens + s.generation_tokens,
        )
        yield family
        if s.spec_accepted_per_position:
            family = CounterMetricFamily(
                f"{self.prefix}:spec_decode_num_accepted_tokens_per_pos",
                "Speculative decoding: drafts accepted at each draft position (0: the first).",
                labels=["model_name", "position"],
            )
            for position, value in enumerate(s.spec_accepted_per_position):
                family.add_metric([self.model_name, str(position)], value)
            yield family
        if self.lora_slots is not None:
            # vLLM's info gauge (what LoRA-aware gateways read): its labels say which adapters run
            # and wait, its value when (the scrape's time: this one series is always the latest)
            family = GaugeMetricFamily(
                f"{self.prefix}:lora_requests_info",
                "Running stats on LoRA requests.",
                labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
            )
            labels = [str(self.lora_slots()), ",".join(s.waiting_lora_adapters), ",".join(s.running_lora_adapters)]
            family.add_metric(labels, time.time())
            yield family


class ServerMetrics:
    def __init__(
        self,
        stats: Callable[[], SchedulerStats],
        model_name: str,
        max_model_len: int,
        lora_slots: Callable[[], int] | None = None,
        prefix: str = "pagoda",
    ) -> None:
        """`lora_slots`: with LoRA, how many adapters may run at once (the server's adapters: a
        step mixes any number), vLLM's `max_lora` label; `prefix`: the names' (pagoda or vllm)."""
        # no `*_created` series beside each counter and histogram (vLLM 0.32 sends them; dashboards do
        # not read them); the switch is prometheus_client's, for the process, which serves one model's
        disable_created_metrics()
        self.registry = CollectorRegistry()
        self.registry.register(_EngineStatsCollector(stats, model_name, lora_slots, prefix))
        # the process's (memory, CPU seconds, open files), Python's and its collector's, as vLLM's
        # /metrics has them from prometheus_client's global registry
        for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
            self.registry.register(collector)
        self.model_name = model_name
        labels = ["model_name"]

        def counter(name: str, help_: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(f"{prefix}:{name}", help_, labels + list(extra), registry=self.registry)

        def histogram(name: str, help_: str, buckets: tuple[float, ...]):
            return Histogram(f"{prefix}:{name}", help_, labels, buckets=buckets, registry=self.registry).labels(
                model_name
            )

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of admitted requests.").labels(model_name)
        self.prompt_tokens_cached = counter(
            "prompt_tokens_cached", "Prompt tokens of admitted requests taken from the prefix cache."
        ).labels(model_name)
        self.generation_tokens = counter("generation_tokens", "Generated tokens.").labels(model_name)
        self._success = counter("request_success", "Finished sequences by finish reason.", ("finished_reason",))
        for reason in FINISH_REASONS:  # each series exists from the start, at 0, as vLLM's
            self._success.labels(model_name, reason)
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token.", TTFT_BUCKETS)
        self.tpot = histogram(
            "request_time_per_output_token_seconds",  # vLLM 0.32's name (time_per_output_token_seconds before)
            "Mean time per output token after the first, per sequence.",
            TPOT_BUCKETS,
        )
        self.itl = histogram(
            "inter_token_latency_seconds", "Time between a sequence's successive token outputs.", TPOT_BUCKETS
        )
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to last token.", LATENCY_BUCKETS)
        self.queue = histogram("request_queue_time_seconds", "Arrival to first scheduled.", LATENCY_BUCKETS)
        self.prefill = histogram("request_prefill_time_seconds", "First scheduled to first token.", LATENCY_BUCKETS)
        self.decode = histogram("request_decode_time_seconds", "First token to last token.", LATENCY_BUCKETS)
        self.inference = histogram("request_inference_time_seconds", "First scheduled to last token.", LATENCY_BUCKETS)
        tokens = token_buckets(max_model_len)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens per sequence.", tokens)
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Generated tokens per sequence.", tokens
        )
        self.request_max_generation_tokens = histogram(
            "request_max_num_generation_tokens",  # vLLM's name; what it counts, as vLLM's: tokens generated
            "Generated tokens of a prompt's longest sequence (of n), per prompt.",
            tokens,
        )
        self.request_params_n = histogram("request_params_n", "The n of each prompt.", N_BUCKETS)
        self.request_params_max_tokens = histogram(
            "request_params_max_tokens", "The max_tokens of each prompt that has one.", tokens
        )
        self.request_computed_prompt_tokens = histogram(
            "request_prefill_kv_computed_tokens",
            "Prompt tokens computed per sequence (not taken from the prefix cache).",
            tokens,
        )
        self.request_preemptions = histogram(
            "request_num_preemptions", "Times a sequence was preempted.", PREEMPTION_BUCKETS
        )

    def first_token(self, out: SequenceOutput, now: float) -> None:
        """Record a sequence's time to first token as its first token arrives (not at its end)."""
        first = out.metrics.first_token_time
        self.ttft.observe((now if first is None else first) - out.metrics.arrival_time)

    def prompt_done(self, outs: list[SequenceOutput], n: int, max_tokens: int | None) -> None:
        """Record a prompt once all its n sequences have ended (`outs`: those that began)."""
        self.request_max_generation_tokens.observe(max((len(out.token_ids) for out in outs), default=0))
        self.request_params_n.observe(n)
        if max_tokens is not None:
            self.request_params_max_tokens.observe(max_tokens)

    def count_finished(self, finish_reason: str) -> None:
        self._success.labels(self.model_name, finish_reason).inc()

    def finished(self, out: SequenceOutput, finish_reason: str, now: float) -> None:
        """Record one sequence at its end; `now` is time.monotonic() (the engine's clock)."""
        self.count_finished(finish_reason)
        m = out.metrics
        self.request_prompt_tokens.observe(m.num_prompt_tokens)
        self.request_generation_tokens.observe(len(out.token_ids))
        self.request_computed_prompt_tokens.observe(m.num_prompt_tokens - m.num_cached_tokens)
        self.request_preemptions.observe(m.num_preemptions)
        if m.first_scheduled_time is not None:
            self.queue.observe(m.first_scheduled_time - m.arrival_time)
        if m.first_token_time is None:
            return
        self.e2e.observe(now - m.arrival_time)
        self.decode.observe(now - m.first_token_time)
        if m.first_scheduled_time is not None:
            self.prefill.observe(m.first_token_time - m.first_scheduled_time)
            self.inference.observe(now - m.first_scheduled_time)
        if len(out.token_ids) > 1:
            self.tpot.observe((now - m.first_token_time) / (len(out.token_ids) - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
