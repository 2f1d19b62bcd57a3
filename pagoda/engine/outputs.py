"""What the engine hands out: per-step core updates, and per-sequence text updates."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagoda.request import TokenLogprob


@dataclass(frozen=True)
class CoreOutput:
    """One request's progress in one step, copied out of the scheduler's live state."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob]
    finish_reason: str | None
    stop_reason: int | str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    prompt_logprobs: list[TokenLogprob] | None = None
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class SequenceOutput:
    """One sequence (one of n) of a request: the delta of this update and the totals so far."""

    request_id: str  # the request as the caller named it
    index: int  # which of its n sequences
    text_delta: str = ""
    token_ids_delta: list[int] = field(default_factory=list)
    logprobs_delta: list[TokenLogprob] = field(default_factory=list)
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
