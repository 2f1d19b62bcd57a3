"""POST /v1/completions: one engine request per prompt; choice index = prompt index * n + sequence
index, as OpenAI numbers them. `echo` with `max_tokens: 0` scores the prompt (lm-eval, perplexity
scripts): the engine computes one token, whose prompt logprobs are the answer, and the response
leaves that token out."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagoda.engine.outputs import SequenceOutput
from pagoda.entrypoints.openai.errors import bad_request
from pagoda.entrypoints.openai.logprobs import (
    before_delta,
    completion_logprobs,
    echo_logprobs,
    join_logprobs,
    vllm_prompt_logprobs,
)
from pagoda.entrypoints.openai.params import check_context, check_token_ids, sampling_params, truncated
from pagoda.entrypoints.openai.protocol import CompletionRequest, TruncationSide
from pagoda.entrypoints.openai.serving import (
    DONE,
    ServerState,
    answer_id,
    beam_search_params,
    chunk_usage,
    event_stream,
    sse,
    usage,
)
from pagoda.entrypoints.openai.streams import Generation

ENDPOINT = "/v1/completions"


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    text: str | None  # as sent; None for token prompts (decoded only if echoed)


async def prompts_of(
    state: ServerState,
    prompt: str | list[str] | list[int] | list[list[int]],
    param: str = "prompt",
    add_special_tokens: bool = True,
) -> list[Prompt]:
    """The prompts of a field (`param`, which a 400 names) that holds text or token ids, one or
    many; texts tokenized with the tokenizer's special tokens unless `add_special_tokens` is False."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise bad_request(f"{param} must not be empty", param)
    if isinstance(prompt[0], int):
        prompt = [prompt]
    if isinstance(prompt[0], list):
        for ids in prompt:
            check_token_ids(ids, state.limits.vocab_size, param)
        return [Prompt(list(ids), None) for ids in prompt]
    size = sum(map(len, prompt))
    encode = state.tokenizer.encode
    encoded = await state.off_loop(
        lambda: [encode(text, add_special_tokens=add_special_tokens) for text in prompt], size=size
    )
    return [Prompt(ids, text) for ids, text in zip(encoded, prompt)]


async def create_completion(state: ServerState, body: CompletionRequest, http: Request) -> Response:
    state.check_request(body)
    if body.prompt is None:
        raise bad_request("prompt: Field required", "prompt")
    prompts = await prompts_of(state, body.prompt)
    if body.truncate_prompt_tokens is not None:
        keep, side = body.truncate_prompt_tokens, body.truncation_side
        prompts = [_truncated(p, keep, side, state.limits.max_model_len) for p in prompts]
    echo_logprobs_k = body.logprobs if body.echo and body.logprobs is not None else None
    prompt_logprobs = max((k for k in (body.prompt_logprobs, echo_logprobs_k) if k is not None), default=None)
    max_tokens = _engine_max_tokens(body)
    params = sampling_params(
        body,
        state.limits,
        max_tokens=max_tokens,
        logprobs=body.logprobs,
        prompt_logprobs=prompt_logprobs,
        renames={},
        reasoning=state.reasoning,
    )
    for p in prompts:
        check_context(len(p.ids), max_tokens, state.limits.max_model_len, "prompt", min_tokens=body.min_tokens)
    candidates = _candidates(body)
    if candidates > body.n:  # the sampled tokens' logprobs rank them
        params = replace(params, n=candidates, logprobs=params.logprobs if params.logprobs is not None else 0)
    await state.check_constraint(body, params)
    request_id = answer_id(http, "cmpl-", body.request_id)
    prompt_ids = [p.ids for p in prompts]
    head = state.answer_head(request_id, "text_completion", body.model)
    if body.use_beam_search:
        search = beam_search_params(body, params)
        outputs = await state.beam_search(
            http, ENDPOINT, request_id, prompt_ids, search, body.cache_salt, body.model, body.logprobs or 0
        )
    else:
        generation = await state.launch(
            http, ENDPOINT, request_id, prompt_ids, params, body.cache_salt, body.model, body.priority
        )
        if body.stream:
            return event_stream(_chunks(state, body, prompts, generation, head), generation)
        outputs = [[_shown(body, out) for out in outs] for outs in await state.collect(http, generation)]
    choices = [
        _choice(state, body, i, prompt, out, _prompt_logprobs(outs))
        for i, (prompt, outs) in enumerate(zip(prompts, outputs))
        for out in _best(outs, body.n)
    ]
    return JSONResponse({**head, "choices": choices, "usage": usage(outputs)})  # every candidate's tokens


def _candidates(body: CompletionRequest) -> int:
    """The samples a prompt draws: OpenAI's best_of (at least n; the best n of them are returned), else n."""
    if body.best_of is None:
        return body.n
    if body.best_of < body.n:
        raise bad_request(f"best_of ({body.best_of}) must be at least n ({body.n})", "best_of")
    if body.best_of > body.n and (body.stream or body.use_beam_search):
        raise bad_request("best_of above n cannot be streamed or beam searched", "best_of")
    return body.best_of


def _best(outs: list[SequenceOutput], n: int) -> list[SequenceOutput]:
    """A prompt's n samples with the highest log probability per token (OpenAI's best_of), in that
    order, numbered 0..n-1 (all of them, numbered so already, where it drew n)."""
    if len(outs) <= n:
        return outs
    ranked = sorted(outs, key=lambda out: -sum(lp.logprob for lp in out.logprobs) / max(1, len(out.logprobs)))
    return [replace(out, index=j) for j, out in enumerate(ranked[:n])]


def _truncated(prompt: Prompt, keep: int, side: TruncationSide | None, max_model_len: int) -> Prompt:
    """The prompt as truncate_prompt_tokens and truncation_side keep it; a shortened prompt echoes
    the text of the tokens kept."""
    ids = truncated(prompt.ids, keep, side, max_model_len)
    return prompt if len(ids) == len(prompt.ids) else Prompt(ids, None)


def _scores_only(body: CompletionRequest) -> bool:
    return body.echo and body.max_tokens == 0


def _engine_max_tokens(body: CompletionRequest) -> int:
    """The prompt's logprobs come with the prefill that samples a first token, so scoring asks for one."""
    if body.max_tokens == 0 and not body.echo:
        raise bad_request("max_tokens must be at least 1 (0 only with echo, to score the prompt)", "max_tokens")
    return 1 if _scores_only(body) else body.max_tokens


def _shown(body: CompletionRequest, out: SequenceOutput) -> SequenceOutput:
    """What the client sees of an update: under scoring, no generated token (the engine's one is
    dropped), and a finished choice ends with `length`, as OpenAI reports max_tokens 0."""
    if not _scores_only(body):
        return out
    return replace(
        out,
        text_delta="",
        token_ids_delta=[],
        logprobs_delta=[],
        text="",
        token_ids=[],
        logprobs=[],
        finish_reason="length" if out.finished else None,
        stop_reason=None,
    )


def _prompt_logprobs(outs: list[SequenceOutput]) -> list:
    """The prompt's logprobs: computed once, with the prefill of the request's first sequence."""
    return max((out.prompt_logprobs for out in outs), key=len, default=[])


def _echo(state: ServerState, prompt: Prompt) -> str:
    return prompt.text if prompt.text is not None else state.tokenizer.decode(prompt.ids)


def _choice(
    state: ServerState, body: CompletionRequest, i: int, prompt: Prompt, out: SequenceOutput, prompt_logprobs: list
) -> dict:
    prefix = _echo(state, prompt) if body.echo else ""
    choice = {
        "index": i * body.n + out.index,
        "text": prefix + out.text,
        "logprobs": None,
        "finish_reason": out.finish_reason,
        "stop_reason": out.stop_reason,
    }
    if body.logprobs is not None:
        generated = completion_logprobs(state.logprob_tokens(body), out.logprobs, len(prefix))
        if body.echo:
            generated = join_logprobs(echo_logprobs(state.logprob_tokens(body), prompt.ids, prompt_logprobs), generated)
        choice["logprobs"] = generated
    if body.prompt_logprobs is not None:
        choice["prompt_logprobs"] = vllm_prompt_logprobs(state.token_texts, prompt.ids, prompt_logprobs)
    if body.return_token_ids:
        choice |= {"prompt_token_ids": prompt.ids, "token_ids": out.token_ids}
    return choice


async def _chunks(
    state: ServerState, body: CompletionRequest, prompts: list[Prompt], generation: Generation, head: dict
) -> AsyncIterator[str]:
    """Per choice: the echoed prompt first (when asked), then text deltas; the chunk that ends a
    choice carries its finish_reason. Then the usage chunk when asked, then [DONE].
    Updates that bring no token (a prefill chunk's prompt logprobs) send nothing; by a choice's
    first token its prompt's logprobs are complete, so the echo goes out then."""
    usage_of = chunk_usage(body, forced=state.config.force_include_usage)

    def chunk(choice: dict, prompt: int, update: SequenceOutput | None, token_ids: list[int], first: bool) -> str:
        shown = {} if usage_of is None else {"usage": usage_of(len(prompts[prompt].ids), update)}
        if body.return_token_ids:  # the prompt's ids with a choice's first chunk, then each chunk's new ones
            choice |= {"prompt_token_ids": prompts[prompt].ids} if first else {}
            choice |= {"token_ids": token_ids}
        return sse({**head, "choices": [choice], **shown})

    offsets: dict[int, int] = {}  # characters sent so far per choice (logprobs' text_offset)
    prompt_lps: list[list] = [[] for _ in prompts]
    final: list[dict[int, SequenceOutput]] = [{} for _ in prompts]
    async for i, engine_update in generation.updates():
        update = _shown(body, engine_update)
        index = i * body.n + update.index
        prompt_lps[i] = max(prompt_lps[i], update.prompt_logprobs, key=len)
        if not update.token_ids_delta and not update.finished:
            continue
        first = index not in offsets
        if first:
            offsets[index] = 0
            if body.echo:
                text = _echo(state, prompts[i])
                logprobs = None
                if body.logprobs is not None:
                    logprobs = echo_logprobs(state.logprob_tokens(body), prompts[i].ids, prompt_lps[i])
                offsets[index] = len(text)
                echo = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": None}
                yield chunk(echo, i, None, [], True)
                first = False
        logprobs = None
        if body.logprobs is not None:
            earlier = before_delta(update.logprobs, update.logprobs_delta)
            logprobs = completion_logprobs(state.logprob_tokens(body), update.logprobs_delta, offsets[index], earlier)
        offsets[index] += len(update.text_delta)
        if update.finished:
            final[i][update.index] = update
        if update.text_delta or update.finished or logprobs is not None or body.return_token_ids:
            yield chunk(
                {
                    "index": index,
                    "text": update.text_delta,
                    "logprobs": logprobs,
                    "finish_reason": update.finish_reason,
                    "stop_reason": update.stop_reason,
                },
                i,
                engine_update,
                update.token_ids_delta,
                first,
            )
    if usage_of is not None:
        yield sse({**head, "choices": [], "usage": usage([[outs[k] for k in sorted(outs)] for outs in final])})
    yield DONE
