"""Request state, written by the scheduler and read by the model runner. Pure Python: no torch."""

from __future__ import annotations

import enum
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from pagoda.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagoda.lora import LoRAAdapter
    from pagoda.pooling_params import Pooling


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class TokenLogprob:
    """The sampled token's log probability and the top alternatives (token id -> logprob)."""

    token_id: int
    logprob: float
    rank: int
    top: dict[int, float]


class Grammar(Protocol):
    """A constrained output's state for one request (pagoda.structured.RequestGrammar): the
    scheduler advances it with each sampled token and ends the request when it is complete, and
    cuts speculative drafts to the part it accepts."""

    @property
    def decides_end(self) -> bool: ...  # whether it decides where the output ends (min_tokens yields)

    @property
    def forcing(self) -> bool: ...  # whether its mask allows one token only (the sampler's edits yield)

    def accept_token(self, token_id: int) -> bool: ...

    def is_terminated(self) -> bool: ...

    def valid_prefix(self, tokens: Sequence[int]) -> int: ...


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    max_model_len: int
    arrival_time: float = field(default_factory=time.monotonic)
    # Requests of one n>1 group share the prompt: all but the first wait for its prefill.
    parent: Request | None = None
    grammar: Grammar | None = None  # the output's constraint or thinking budget, if the request has one
    # sampling_params.bad_words as token sequences (the engine's tokenizer makes them)
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    # vLLM's cache_salt: only requests with the same salt share KV
    cache_salt: str | None = None
    lora: LoRAAdapter | None = None  # the adapter it runs, if any
    priority: int = 0  # vLLM's: under the priority policy, lower is served first
    # an embedding request: it ends when its prompt is computed, with the prompt's vector, no token
    pooling: Pooling | None = None

    def __post_init__(self) -> None:
        self.token_ids: list[int] = list(self.prompt_token_ids)  # prompt, then outputs
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        self.num_cached_tokens = 0  # prompt tokens taken from the prefix cache at first admission
        self.block_ids: list[int] = []
        self.status = RequestStatus.WAITING
        self.finish_reason: str | None = None  # "stop", "length" or "abort"
        self.stop_reason: int | str | None = None  # the stop token id or stop string that ended it
        self.num_prompt_logprobs = 0  # prompt positions whose logprobs were handed out (kept across preemption)
        self.num_preemptions = 0
        self.num_skips = 0  # times the longest-prefix-match policy admitted a later request first
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None

    @property
    def cache_namespace(self) -> Hashable:
        """The prefix cache's namespace: only requests with the same salt and adapter weights share
        KV (None: no salt, the base model)."""
        return self.cache_salt if self.lora is None else (self.cache_salt, self.lora.uid)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed_tokens < self.num_prompt_tokens

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def check_stop(self) -> str | None:
        """Finish reason implied by the last appended token, or None to go on."""
        params = self.sampling_params
        last = self.token_ids[-1]
        if self.grammar is not None and self.grammar.is_terminated():
            return "stop"  # the constrained output is complete (its stop token accepted, if any)
        num_out = self.num_output_tokens
        if num_out >= params.min_tokens:
            if not params.ignore_eos and last in self.eos_token_ids:
                return "stop"
            if last in params.stop_token_ids:
                self.stop_reason = last
                return "stop"
        if params.max_tokens is not None and num_out >= params.max_tokens:
            return "length"
        if self.num_tokens >= self.max_model_len:
            return "length"
        return None
