"""What the engine hands its callers: per-sequence text updates. (The engine core's per-step
updates, `CoreOutput`, live in pagoda.core.outputs.)"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagoda.core.outputs import RequestMetrics
from pagoda.request import TokenLogprob


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
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    embedding: list[float] | None = None  # an embedding request's vector, once finished

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
