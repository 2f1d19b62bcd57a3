"""What the offline API (`LLM.generate`, `LLM.chat`, `LLM.embed`) returns, shaped as vLLM's
`RequestOutput`, `CompletionOutput` and `EmbeddingRequestOutput`, so scripts written for vLLM's
offline API read Pagoda's results unchanged. Built from the engine's finished `SequenceOutput`s;
nothing of the engine's internals is kept."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

from pagoda.core.outputs import RequestMetrics
from pagoda.engine.outputs import SequenceOutput
from pagoda.lora import LoRARequest
from pagoda.request import TokenLogprob

# a token's decoded_token, given the sequence's last CONTEXT tokens before it (None under detokenize=False)
DecodeToken = Callable[[int, Sequence[int]], str | None]
INCOMPLETE = "\ufffd"  # what a tokenizer decodes a piece of a character to
CONTEXT = 4  # the tokens before one that its decoded text may complete a character of (vLLM's)


def context(ids: Sequence[int], position: int) -> Sequence[int]:
    """The tokens before `position` a decoded token reads: the last CONTEXT (not all: per position,
    all would make a long sequence's logprobs quadratic)."""
    return ids[max(0, position - CONTEXT) : position]


class DecodedTokens:
    """vLLM's Logprob.decoded_token: a token's own text, but where that ends in an incomplete
    character (a byte-level piece of one), the text it completes after up to 4 of the sequence's
    tokens before it, and "" while it completes none: so the sampled tokens' texts, joined, are
    the text, where each token's own would leave U+FFFD for every piece."""

    def __init__(self, tokenizer) -> None:
        self._decode = tokenizer.decode
        self.own = lru_cache(maxsize=65536)(lambda token_id: tokenizer.decode([token_id]))

    def __call__(self, token_id: int, before: Sequence[int]) -> str:
        text = self.own(token_id)
        if not text.endswith(INCOMPLETE):
            return text
        for n in range(1, min(len(before), CONTEXT) + 1):
            window = list(before[-n:])
            whole = self._decode([*window, token_id])
            if whole.endswith(INCOMPLETE):
                continue
            clean = n  # the window's tokens before the pieces this one completes
            while clean > 0 and self.own(window[clean - 1]).endswith(INCOMPLETE):
                clean -= 1
            prefix = self._decode(window[:clean]) if clean else ""
            return whole[len(os.path.commonprefix([prefix, whole])) :]
        return ""


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


def position_logprobs(lp: TokenLogprob, decode: DecodeToken, before: Sequence[int]) -> PositionLogprobs:
    """`lp.top` is ordered most likely first, so its ranks are 1..k; the chosen token keeps its own.
    `before`: the tokens before the position, its candidates' texts' context."""
    ranked = {
        token: Logprob(value, rank, decode(token, before)) for rank, (token, value) in enumerate(lp.top.items(), 1)
    }
    return {lp.token_id: Logprob(lp.logprob, lp.rank, decode(lp.token_id, before)), **ranked}


def completion_output(
    seq: SequenceOutput, asked_logprobs: bool, decode: DecodeToken, lora: LoRARequest | None = None
) -> CompletionOutput:
    # as vLLM's, an output token's context is the output before it
    ids = seq.token_ids
    logprobs = (
        [position_logprobs(lp, decode, context(ids, j)) for j, lp in enumerate(seq.logprobs)]
        if asked_logprobs
        else None
    )
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
        prompt_logprobs = [
            None if lp is None else position_logprobs(lp, decode, context(prompt_token_ids, i))
            for i, lp in enumerate(whole)
        ]
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


@dataclass
class EmbeddingOutput:
    """vLLM's: one prompt's vector."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """vLLM's: what `LLM.embed` returns per prompt."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    num_cached_tokens: int = 0  # prompt tokens the prefix cache served
    finished: bool = True
