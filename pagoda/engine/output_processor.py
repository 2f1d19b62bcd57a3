"""From token ids to text: per-sequence detokenization, stop strings, and the updates handed to
callers. Runs beside the engine core (in the server, on the event loop, not the engine thread)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagoda.core.outputs import CoreOutput, RequestMetrics
from pagoda.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from pagoda.engine.outputs import SequenceOutput
from pagoda.request import Grammar, Request
from pagoda.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagoda.lora import LoRAAdapter


def make_requests(
    request_id: str,
    prompt_ids: list[int],
    params: SamplingParams,
    eos_ids,
    max_model_len: int,
    new_grammar: Callable[[], Grammar] | None = None,
    bad_words_ids: tuple[tuple[int, ...], ...] = (),
    cache_salt: str | None = None,
    lora: LoRAAdapter | None = None,
    priority: int = 0,
) -> list[Request]:
    """The engine requests of one caller request: one per sequence; siblings of n > 1 share the
    prompt through the first one, seeded siblings get consecutive seeds, and a constrained
    request's sequences each get a grammar state of their own from `new_grammar`."""
    requests: list[Request] = []
    for i in range(params.n):
        seed = None if params.seed is None or i == 0 else params.seed + i
        requests.append(
            Request(
                f"{request_id}#{i}",
                prompt_ids,
                params if i == 0 else dataclasses.replace(params, seed=seed),
                frozenset(eos_ids),
                max_model_len,
                parent=requests[0] if requests else None,
                grammar=new_grammar() if new_grammar is not None else None,
                bad_words_ids=bad_words_ids,
                cache_salt=cache_salt,
                lora=lora,
                priority=priority,
            )
        )
    return requests


@dataclass
class _Sequence:
    out: SequenceOutput
    detokenizer: IncrementalDetokenizer
    stops: StopStringMatcher
    min_tokens: int  # stop strings count only in the text of the tokens after these (vLLM's rule)
    detokenize: bool  # False: token ids only, the text stays empty (vLLM's detokenize=False)
    emitted: int = 0  # characters of out.text already handed out
    full_text: str = field(default="")


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.sequences: dict[str, _Sequence] = {}

    def add(self, request_id: str, requests: list[Request]) -> None:
        for index, request in enumerate(requests):
            params = request.sampling_params
            self.sequences[request.request_id] = _Sequence(
                out=SequenceOutput(
                    request_id=request_id,
                    index=index,
                    metrics=RequestMetrics(num_prompt_tokens=request.num_prompt_tokens),
                    prompt_logprobs=[None] if params.prompt_logprobs is not None else [],
                ),
                detokenizer=IncrementalDetokenizer(
                    self.tokenizer, request.prompt_token_ids, params.skip_special_tokens
                ),
                stops=StopStringMatcher(params.stop, params.include_stop_str_in_output),
                min_tokens=params.min_tokens,
                detokenize=params.detokenize,
            )

    def drop(self, engine_request_id: str) -> None:
        self.sequences.pop(engine_request_id, None)

    def process(self, outputs: list[CoreOutput]) -> tuple[list[SequenceOutput], list[tuple[str, str]]]:
        """Updates for callers, and (engine request id, stop string) of sequences a stop string ended."""
        updates, stopped = [], []
        for core in outputs:
            seq = self.sequences.get(core.request_id)
            if seq is None:
                continue
            hit = self._apply(seq, core)
            if hit is not None and not core.finished:
                stopped.append((core.request_id, hit))
            updates.append(self._delta(seq))
            if seq.out.finished:
                del self.sequences[core.request_id]
        return updates, stopped

    def _apply(self, seq: _Sequence, core: CoreOutput) -> str | None:
        out = seq.out
        out.metrics = core.metrics
        if core.prompt_logprobs:
            out.prompt_logprobs += core.prompt_logprobs
        if core.embedding is not None:
            out.embedding = core.embedding
        tokens = core.new_token_ids
        hit = None
        # token by token: a step may bring several (speculative decoding), and a stop string that
        # the first of them completes ends the output there, as it would one token at a time
        steps = list(tokens) or [None]  # a finished output with no new token still flushes
        if not seq.detokenize:
            steps = []  # token ids only: no text to build, and no stop string can be in it
        # the token that stopped the output (an end-of-sequence or stop_token_ids token, or the one
        # that ended a grammar) leaves its text out, unless the stop is asked into the output: vLLM's rule
        stop_token = core.finish_reason == "stop" and not seq.stops.include_in_output
        for count, token in enumerate(steps, 1):
            last = core.finished and count == len(steps)
            new_text = seq.detokenizer.add(token) if token is not None and not (last and stop_token) else ""
            if last:
                new_text += seq.detokenizer.flush()
            seq.full_text += new_text
            counted = len(out.token_ids) + count > seq.min_tokens
            hit = seq.stops.find(seq.full_text, len(new_text)) if new_text and seq.stops.stop and counted else None
            if hit is not None:
                tokens = tokens[:count]
                break
        out.token_ids_delta = list(tokens)
        out.logprobs_delta = list(core.new_logprobs[: len(tokens)])
        out.token_ids += out.token_ids_delta
        out.logprobs += out.logprobs_delta
        if hit is not None:
            stop_string, cut = hit
            seq.full_text = seq.full_text[:cut]
            out.finish_reason, out.stop_reason = "stop", stop_string
            return stop_string
        if core.finished:
            out.finish_reason, out.stop_reason = core.finish_reason, core.stop_reason
        return None

    def _delta(self, seq: _Sequence) -> SequenceOutput:
        out = seq.out
        visible = len(seq.full_text) if out.finished else max(seq.emitted, len(seq.full_text) - seq.stops.holdback)
        out.text_delta = seq.full_text[seq.emitted : visible]
        out.text = seq.full_text[:visible]
        seq.emitted = visible
        return dataclasses.replace(out, token_ids=list(out.token_ids), logprobs=list(out.logprobs))
