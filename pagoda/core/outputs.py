"""What crosses the seams around the scheduler, in the order data flows: the scheduler's step
(`SchedulerOutput`) to the model runner, the runner's results (`ModelRunnerOutput`) back to the
scheduler, and the step's per-request progress with the engine's counters (`StepOutputs`) out to
whoever drives the engine. Pure Python: the model runner imports this module, not the scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagoda.request import Request, TokenLogprob


@dataclass(frozen=True)
class SchedulerOutput:
    """The requests of one step, in the scheduler's order, and how many new tokens each computes.
    `finished_request_ids`: requests that ended since the previous step (the runner drops their
    per-request state, such as a seeded request's random generator). `draft_token_ids`: per
    request that speculates this step, its proposed next tokens; such a request's count of new
    tokens is 1 + len(drafts), its last token followed by the drafts."""

    scheduled: tuple[tuple[Request, int], ...]
    num_batched_tokens: int
    finished_request_ids: frozenset[str] = frozenset()
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(frozen=True)
class ModelRunnerOutput:
    """Per scheduled request, in the step's order: the sampled token (None while its prefill is
    unfinished), its logprobs, and the prompt logprobs computed this step. A request that
    speculated also has its accepted drafts (with their logprobs), which come before its
    sampled token; None where no request speculated. An embedding request whose prompt ended
    this step has its vector (`embeddings`, None where no request has one) and no token."""

    token_ids: list[int | None]
    logprobs: list[TokenLogprob | None]
    prompt_logprobs: list[list[TokenLogprob] | None]
    accepted_drafts: list[list[int]] | None = None
    accepted_logprobs: list[list[TokenLogprob | None]] | None = None
    embeddings: list[list[float] | None] | None = None


@dataclass(frozen=True)
class RequestMetrics:
    """A request's sizes and times (time.monotonic()), as its outputs report them."""

    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens reused (prefix cache or an n > 1 sibling) at first admission
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    num_preemptions: int = 0  # times it was preempted (its KV recomputed after)


# The bounds of the histogram of tokens a step computes for prompts and samples (vLLM's
# iteration_tokens_total buckets): a step of n tokens counts in the first bucket whose bound is >= n.
STEP_TOKEN_BOUNDS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass(frozen=True)
class CoreOutput:
    """One request's progress in one step, copied out of the scheduler's live state."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob]
    finish_reason: str | None
    stop_reason: int | str | None
    metrics: RequestMetrics
    prompt_logprobs: list[TokenLogprob] | None = None
    embedding: list[float] | None = None  # an embedding request's vector, as it finishes

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class SchedulerStats:
    """The engine's counters after a step (the server's /metrics and logs read these)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up at first admission
    prefix_cache_hits: int = 0  # of which reused
    prefix_cache_blocks: int = 0
    num_steps: int = 0
    prompt_tokens: int = 0  # prompt tokens computed so far (prefix-cache hits are not computed)
    generation_tokens: int = 0  # tokens sampled so far
    # steps by their prompt tokens computed plus tokens sampled: counts per STEP_TOKEN_BOUNDS bucket
    # (not cumulative; the last entry: steps above every bound); their sum is the two counters above
    step_token_counts: tuple[int, ...] = (0,) * (len(STEP_TOKEN_BOUNDS) + 1)
    # speculative decoding, cumulative (pagoda/core/spec_decode.py): requests that speculated in a
    # step, drafts proposed, drafts accepted, and acceptances per draft position
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: tuple[int, ...] = ()
    # the LoRA adapters (by name) of the running and of the waiting requests, each once
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()


@dataclass(frozen=True)
class StepOutputs:
    outputs: list[CoreOutput] = field(default_factory=list)
    stats: SchedulerStats = field(default_factory=SchedulerStats)
