"""POST /v1/chat/completions: messages -> chat template -> one engine request (n sequences)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

import jinja2
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagoda.config import ConfigError
from pagoda.engine.outputs import SequenceOutput
from pagoda.entrypoints.openai.errors import bad_request
from pagoda.entrypoints.openai.logprobs import chat_logprobs, vllm_prompt_logprobs
from pagoda.entrypoints.openai.params import check_context, sampling_params
from pagoda.entrypoints.openai.protocol import ChatCompletionRequest
from pagoda.entrypoints.openai.serving import DONE, ServerState, event_stream, sse, usage
from pagoda.entrypoints.openai.streams import Generation
from pagoda.model_files import apply_chat_template

ENDPOINT = "/v1/chat/completions"
ROLES = ("system", "user", "assistant")


def parse_messages(messages: list[dict]) -> list[dict[str, str]]:
    """Messages as the chat template takes them: role and text content; text parts are joined."""
    return [{"role": _role(m, i), "content": _content(m.get("content"), i)} for i, m in enumerate(messages)]


def _role(message: dict, i: int) -> str:
    role = message.get("role")
    if role not in ROLES:
        raise bad_request(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r}", f"messages[{i}].role")
    return role


def _content(content: object, i: int) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"messages[{i}].content must be a string or a list of text parts", f"messages[{i}].content")
    texts = []
    for j, part in enumerate(content):
        param = f"messages[{i}].content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            raise bad_request(
                f"{param}.type {kind!r} is not supported: this server takes text parts only", f"{param}.type"
            )
        if not isinstance(part.get("text"), str):
            raise bad_request(f"{param}.text must be a string", f"{param}.text")
        texts.append(part["text"])
    return "\n".join(texts)


def render(state: ServerState, messages: list[dict[str, str]]) -> list[int]:
    try:
        return apply_chat_template(state.tokenizer, messages, state.config.chat_template)
    except (ConfigError, jinja2.TemplateError) as exc:
        raise bad_request(f"The chat template cannot render these messages: {exc}", "messages") from None


async def create_chat_completion(state: ServerState, body: ChatCompletionRequest, http: Request) -> Response:
    state.check_request(body)
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
    messages = parse_messages(body.messages)
    size = sum(len(m["content"]) for m in messages)
    prompt_ids = await state.off_loop(render, state, messages, size=size)
    max_param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    params = sampling_params(
        body,
        state.limits,
        max_tokens=max_tokens,
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        prompt_logprobs=body.prompt_logprobs,
        renames={"logprobs": "top_logprobs", "max_tokens": max_param},
    )
    check_context(len(prompt_ids), max_tokens, state.limits.max_model_len, "messages")
    await state.check_constraint(body, params)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    generation = await state.launch(http, ENDPOINT, request_id, [prompt_ids], params)
    head = {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": state.model_name}
    if body.stream:
        return event_stream(_chunks(state, body, generation, head), generation)
    outputs = (await state.collect(http, generation))[0]
    return JSONResponse(_response(state, body, head, prompt_ids, outputs))


def _response(
    state: ServerState, body: ChatCompletionRequest, head: dict, prompt_ids: list[int], outputs: list[SequenceOutput]
) -> dict:
    choices = [
        {
            "index": out.index,
            "message": {"role": "assistant", "content": out.text},
            "logprobs": chat_logprobs(state.token_texts, out.logprobs, body.top_logprobs or 0)
            if body.logprobs
            else None,
            "finish_reason": out.finish_reason,
            "stop_reason": out.stop_reason,
        }
        for out in outputs
    ]
    response = {**head, "choices": choices, "usage": usage([outputs])}
    if body.prompt_logprobs is not None:
        response["prompt_logprobs"] = vllm_prompt_logprobs(state.token_texts, prompt_ids, outputs[0].prompt_logprobs)
    return response


async def _chunks(
    state: ServerState, body: ChatCompletionRequest, generation: Generation, head: dict
) -> AsyncIterator[str]:
    """OpenAI's chunk sequence per choice: the role with empty content, content deltas, a chunk
    with only finish_reason; then the usage chunk (choices []) when asked, then [DONE]."""
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    base = {**head, "object": "chat.completion.chunk"}

    def chunk(choice: dict) -> str:
        return sse({**base, "choices": [choice], **({"usage": None} if include_usage else {})})

    for index in range(body.n):
        yield chunk(
            {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        )
    final: dict[int, SequenceOutput] = {}
    async for _, update in generation.updates():
        if update.text_delta or (body.logprobs and update.logprobs_delta):
            logprobs = (
                chat_logprobs(state.token_texts, update.logprobs_delta, body.top_logprobs or 0)
                if body.logprobs
                else None
            )
            yield chunk(
                {
                    "index": update.index,
                    "delta": {"content": update.text_delta},
                    "logprobs": logprobs,
                    "finish_reason": None,
                }
            )
        if update.finished:
            final[update.index] = update
            yield chunk(
                {
                    "index": update.index,
                    "delta": {},
                    "logprobs": None,
                    "finish_reason": update.finish_reason,
                    "stop_reason": update.stop_reason,
                }
            )
    if include_usage:
        yield sse({**base, "choices": [], "usage": usage([[final[k] for k in sorted(final)]])})
    yield DONE
