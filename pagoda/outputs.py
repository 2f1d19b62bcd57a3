"""What the offline API (`LLM.generate`, `LLM.chat`) returns, shaped as vLLM's `RequestOutput` and
`CompletionOutput`, so scripts written for vLLM's offline API read Pagoda's results unchanged.
Built from the engine's finished `SequenceOutput`s; nothing of the engine's internals is kept."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pagoda.core.outputs import RequestMetrics
from pagoda.engine.outputs import SequenceOutput
from pagoda.lora import LoRARequest
from pagoda.request import TokenLogprob

DecodeToken = Callable[[int], str | None]


@dataclass
class Logprob:
    logprob: float
    rank: int  # 1 is the most likely token
    decoded_token: str | None  # None where the request asked detokenize=False


# Per position: token id -> Logprob, the sampled (or prompt) token and the top alternatives.
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One of a request's n sequences."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None  # None unless logprobs were asked for (as vLLM)
    logprobs: list[PositionLogprobs] | None  # one entry per token when asked for
    finish_reason: str | None  # "stop" or "length"
    stop_reason: int | str | None = None  # the stop string or token id that ended it
    lora_request: LoRARequest | None = None  # the adapter it ran (vLLM's)

    def finished(self) -> bool:
        """vLLM's: whether it has ended (offline answers always have)."""
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None  # the text as given; None for a token-id prompt
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None  # the first entry is None
    outputs: list[CompletionOutput]  # by index
    finished: bool
    num_cached_tokens: int  # prompt tokens taken from the prefix cache
    # the first sequence's sizes and times (arrival, first scheduled, first token: time.monotonic())
    metrics: RequestMetrics | None = None
    lora_request: LoRARequest | None = None  # the adapter it ran (vLLM's)


def position_logprobs(lp: TokenLogprob, decode: DecodeToken) -> PositionLogprobs:
    """`lp.top` is ordered most likely first, so its ranks are 1..k; the chosen token keeps its own."""
    ranked = {token: Logprob(value, rank, decode(token)) for rank, (token, value) in enumerate(lp.top.items(), 1)}
    return {lp.token_id: Logprob(lp.logprob, lp.rank, decode(lp.token_id)), **ranked}


def completion_output(
    seq: SequenceOutput, asked_logprobs: bool, decode: DecodeToken, lora: LoRARequest | None = None
) -> CompletionOutput:
    logprobs = [position_logprobs(lp, decode) for lp in seq.logprobs] if asked_logprobs else None
    return CompletionOutput(
        index=seq.index,
        text=seq.text,
        token_ids=list(seq.token_ids),
        cumulative_logprob=sum(lp.logprob for lp in seq.logprobs) if asked_logprobs else None,
        logprobs=logprobs,
        finish_reason=seq.finish_reason,
        stop_reason=seq.stop_reason,
        lora_request=lora,
    )


def request_output(
    request_id: str,
    prompt: str | None,
    prompt_token_ids: list[int],
    sequences: Sequence[SequenceOutput],
    asked: tuple[bool, bool],
    decode: DecodeToken,
    lora: LoRARequest | None = None,
) -> RequestOutput:
    """`sequences`: the request's finished sequences, by index; `asked`: (logprobs, prompt_logprobs);
    `lora`: the adapter it ran. The prompt's logprobs come with the prefill of the first sequence, so
    the longest list is whole."""
    asked_logprobs, asked_prompt = asked
    prompt_logprobs = None
    if asked_prompt:
        whole = max((seq.prompt_logprobs for seq in sequences), key=len)
        prompt_logprobs = [None if lp is None else position_logprobs(lp, decode) for lp in whole]
    return RequestOutput(
        request_id=request_id,
        prompt=prompt,
        prompt_token_ids=prompt_token_ids,
        prompt_logprobs=prompt_logprobs,
        outputs=[completion_output(seq, asked_logprobs, decode, lora) for seq in sequences],
        finished=True,
        num_cached_tokens=sequences[0].metrics.num_cached_tokens,
        metrics=sequences[0].metrics,
        lora_request=lora,
    )
