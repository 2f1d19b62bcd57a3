"""Anthropic's Messages API (POST /v1/messages and /v1/messages/count_tokens), as vLLM serves it:
each request becomes the chat request that asks for the same thing and runs on the chat path
(template, tools, reasoning, constraints); its deltas become content blocks (text, thinking,
tool_use) and, streamed, Anthropic's events. Errors raised here are Anthropic's error objects.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from pagoda.engine.outputs import SequenceOutput
from pagoda.entrypoints.openai import chat
from pagoda.entrypoints.openai.errors import APIError, bad_request, log_rejection, renamed
from pagoda.entrypoints.openai.protocol import (
    AnthropicCountTokensRequest,
    AnthropicMessagesRequest,
    ChatCompletionRequest,
)
from pagoda.entrypoints.openai.responses import chat_tool_choice
from pagoda.entrypoints.openai.serving import ServerState, cancel_on_disconnect, event_stream, usage
from pagoda.entrypoints.openai.streams import Generation
from pagoda.entrypoints.openai.tool_calls import MessageStreamer, ToolPlan

ENDPOINT = "/v1/messages"
MIN_THINKING_BUDGET = 1024  # Anthropic's least budget_tokens
EFFORTS = ("low", "medium", "high", "xhigh", "max")  # output_config.effort's values (vLLM's)
# a chat field's name in the chat path's 400s, and its name in a Messages request (messages[k] are
# mapped to their Messages places first: see _Translation.renamed)
RENAMES = (
    (re.compile(r"^tools\[(\d+)\]\.function\.parameters\b"), r"tools[\1].input_schema"),
    (re.compile(r"^tools\[(\d+)\]\.function\b"), r"tools[\1]"),
    (re.compile(r"^response_format\b.*"), "output_config.format"),
    (re.compile(r"^stop\b"), "stop_sequences"),
    (re.compile(r"^max_completion_tokens\b"), "max_tokens"),
    (re.compile(r"^user\b"), "metadata.user_id"),
    (re.compile(r"^thinking_token_budget\b"), "thinking.budget_tokens"),
)
# Anthropic's error type for an HTTP status (others: api_error)
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def error_response(http: Request, exc: APIError) -> JSONResponse:
    """An APIError as Anthropic's error object (its type from the status), logged as every refusal is."""
    log_rejection(http, exc)
    return JSONResponse(_error(exc), status_code=exc.status, headers=exc.headers)


async def create_message(state: ServerState, body: AnthropicMessagesRequest, http: Request) -> Response:
    try:
        translation = _Translation(body, state)
        prepared = await translation.prepare(state)
        message_id = f"msg_{uuid.uuid4().hex}"
        generation = await state.launch(
            http, ENDPOINT, message_id, [prepared.prompt_ids], prepared.params, body.cache_salt, body.model
        )
    except APIError as exc:
        return error_response(http, exc)
    head = {"id": message_id, "type": "message", "role": "assistant", "model": state.answering_model(body.model)}
    if body.stream:
        return event_stream(_events(prepared.plan, generation, head, len(prepared.prompt_ids)), generation)
    answer = _Answer(prepared.plan)

    async def whole() -> None:  # built update by update, as a stream builds it: the same blocks
        async for _ in answer.events(generation):
            pass
        answer.blocks.finish()

    try:
        await cancel_on_disconnect(http, whole())
    except APIError as exc:
        return error_response(http, exc)
    finally:
        generation.close()
    content = {"content": answer.blocks.blocks, "usage": _usage(answer.final)}
    return JSONResponse({**head, **answer.ending(), **content})


async def count_tokens(state: ServerState, body: AnthropicCountTokensRequest, http: Request) -> Response:
    """The prompt's tokens as /v1/messages would render it."""
    try:
        fields = {**body.model_dump(exclude_none=True, by_alias=True), "max_tokens": 1}
        if isinstance(body.thinking, dict) and body.thinking.get("type") == "enabled":  # its budget checks max_tokens
            fields["thinking"] = {"type": "adaptive"}
        whole = AnthropicMessagesRequest.model_validate(fields)
        prepared = await _Translation(whole, state).prepare(state)
    except APIError as exc:
        return error_response(http, exc)
    return JSONResponse({"input_tokens": len(prepared.prompt_ids)})


# ---- the request ------------------------------------------------------------------------------


class _Translation:
    """A Messages request as the chat request that asks for the same thing, with the Messages place
    of each chat message, so that the chat path's 400s name the Messages field.
    Where the server reads calls out of free text (--enable-auto-tool-choice), tools with no
    tool_choice may be called; without it, they are shown to the model and its answer taken as text
    (vLLM's rule). A conversation that ends with the assistant's text is continued from it (Anthropic's
    prefill). Where it has a reasoning parser, an enabled thinking's budget_tokens bounds the
    thinking (vLLM's thinking_token_budget); without one the model has no thinking to bound, and
    the budget is only checked, as Anthropic checks it."""

    def __init__(self, body: AnthropicMessagesRequest, state: ServerState) -> None:
        self.places: list[str] = []  # per chat message, where it came from
        self.calls: dict[int, list[str]] = {}  # per assistant chat message, where each of its calls came from
        messages = self._system(body) + [m for i, message in enumerate(body.messages) for m in self._turn(message, i)]
        choice, parallel = _tool_choice(body.tool_choice, bool(body.tools), state.config.tools.enable_auto_tool_choice)
        effort, budget = _thinking(body)
        prefill = self._prefill(messages)
        fields = {
            "model": body.model,
            "messages": messages,
            "add_generation_prompt": not prefill,
            "continue_final_message": prefill,
            "max_tokens": body.max_tokens,
            "stop": body.stop_sequences,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "top_k": body.top_k,
            "user": (body.metadata or {}).get("user_id"),
            "tools": _tools(body.tools),
            "tool_choice": choice,
            "parallel_tool_calls": parallel,
            "response_format": _response_format(body.output_config),
            "reasoning_effort": effort,
            "thinking_token_budget": budget if state.reasoning is not None else None,
            "chat_template_kwargs": body.chat_template_kwargs,
            "cache_salt": body.cache_salt,
        }
        try:
            self.request = ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
        except ValidationError as exc:  # a value the chat request refuses
            error = exc.errors()[0]
            place = ".".join(str(part) for part in error["loc"])
            raise self.renamed(bad_request(f"{place}: {error['msg']}", place)) from None

    async def prepare(self, state: ServerState) -> chat.PreparedChat:
        """The chat path's checks and rendering; its 400s name the Messages field."""
        try:
            return await chat.prepare(state, self.request)
        except APIError as exc:
            raise self.renamed(exc) from None

    def renamed(self, exc: APIError) -> APIError:
        """A chat 400 with its field named as the Messages request names it."""
        param = exc.param or ""
        found = re.match(r"^messages\[(\d+)\]", param)
        if found and int(found[1]) < len(self.places):
            index, rest = int(found[1]), param[found.end() :]
            call = re.match(r"^\.tool_calls\[(\d+)\]", rest)
            if call and int(call[1]) < len(self.calls.get(index, ())):  # a tool_use block's field
                inner = rest[call.end() :]
                inner = {".function.name": ".name", ".function.arguments": ".input", ".function": ""}.get(inner, inner)
                return renamed(exc, self.calls[index][int(call[1])] + inner)
            return renamed(exc, self.places[index] + rest.replace(".tool_call_id", ".tool_use_id"))
        for pattern, name in RENAMES:
            if pattern.match(param):
                return renamed(exc, pattern.sub(name, param))
        return exc

    def _prefill(self, messages: list[dict]) -> bool:
        """Whether the conversation ends with an assistant's text, which the answer continues (Anthropic's
        prefill: the answer's content is what follows it) rather than answers; a 400 where that text ends in
        whitespace, as Anthropic refuses it."""
        last = messages[-1] if messages else {}
        if last.get("role") != "assistant" or last.get("tool_calls"):
            return False
        if last["content"] != last["content"].rstrip():
            param = f"{self.places[-1]}.content"
            raise bad_request(f"{param}: the final assistant content cannot end with trailing whitespace", param)
        return True

    def _system(self, body: AnthropicMessagesRequest) -> list[dict]:
        """`system`, and system-role messages in `messages` (as Claude Code sends per-turn
        reminders), as one system message first (vLLM's rule)."""
        texts = [] if body.system is None else [chat.text_content(body.system, "system")]
        for i, message in enumerate(body.messages):
            if isinstance(message, dict) and message.get("role") == "system":
                texts.append(chat.text_content(message.get("content"), f"messages[{i}].content"))
        if not texts:
            return []
        self.places.append("system")
        return [{"role": "system", "content": "\n".join(texts)}]

    def _turn(self, message: Any, i: int) -> list[dict]:
        """One Anthropic message as chat messages: a user turn's tool_result blocks become tool
        messages (before its text), an assistant turn's tool_use blocks its tool calls; thinking
        blocks are dropped (chat templates show no earlier turn's reasoning)."""
        where = f"messages[{i}]"
        role = message.get("role") if isinstance(message, dict) else None
        if role == "system":
            return []  # in the system message (_system)
        if role not in ("user", "assistant"):
            raise bad_request(f"{where}.role must be 'user', 'assistant' or 'system'", f"{where}.role")
        content = message.get("content")
        if isinstance(content, str):
            self.places.append(where)
            return [{"role": role, "content": content}]
        if not isinstance(content, list):
            raise bad_request(f"{where}.content must be a string or a list of content blocks", f"{where}.content")
        texts, calls, results, call_places = [], [], [], []
        for j, block in enumerate(content):
            place = f"{where}.content[{j}]"
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text":
                texts.append(_string(block, "text", place))
            elif kind == "tool_use" and role == "assistant":
                arguments = block.get("input", {})
                if not isinstance(arguments, dict):
                    raise bad_request(f"{place}.input must be an object", f"{place}.input")
                arguments_json = json.dumps(arguments, ensure_ascii=False)
                function = {"name": _string(block, "name", place), "arguments": arguments_json}
                calls.append({"id": _string(block, "id", place), "type": "function", "function": function})
                call_places.append(place)
            elif kind == "tool_result" and role == "user":
                result = block.get("content", "")
                text = result if isinstance(result, str) else chat.text_content(result, f"{place}.content")
                results.append({"role": "tool", "tool_call_id": _string(block, "tool_use_id", place), "content": text})
                self.places.append(place)
            elif kind in ("thinking", "redacted_thinking") and role == "assistant":
                continue
            else:
                raise bad_request(
                    f"{place}.type {kind!r} is not supported in a {role} message: this server takes text, "
                    "tool_use (assistant), tool_result (user) and thinking (assistant) blocks",
                    f"{place}.type",
                )
        if role == "assistant":
            self.calls[len(self.places)] = call_places
            self.places.append(where)
            turn: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts) if texts or not calls else None}
            return [turn | ({"tool_calls": calls} if calls else {})]
        if texts or not results:
            self.places.append(where)
            return [*results, {"role": "user", "content": "\n".join(texts)}]
        return results


def _string(block: dict, key: str, where: str) -> str:
    value = block.get(key)
    if not isinstance(value, str):
        raise bad_request(f"{where}.{key} must be a string", f"{where}.{key}")
    return value


def _tools(tools: list[Any] | None) -> list[dict] | None:
    """Anthropic's custom tools as chat function tools (its server tools are not run here)."""
    if not tools:
        return None
    functions = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "custom") != "custom" or "input_schema" not in tool:
            raise bad_request(
                f"tools[{i}] must be a custom tool with a name and an input_schema: this server runs no server tools",
                f"tools[{i}]",
            )
        function = {"name": tool.get("name"), "parameters": tool["input_schema"]}
        for name in ("description", "strict"):  # strict: its input validates, or the request is refused
            if name in tool:
                function[name] = tool[name]
        functions.append({"type": "function", "function": function})
    return functions


def _tool_choice(choice: Any, has_tools: bool, auto_tools: bool) -> tuple[Any, bool | None]:
    """Anthropic's tool_choice as the chat's, and parallel_tool_calls (false where it disables
    parallel tool use)."""
    if choice is None:
        return chat_tool_choice(None, has_tools, auto_tools), None
    kind = choice.get("type") if isinstance(choice, dict) else None
    kind = kind if isinstance(kind, str) else None
    parallel = False if isinstance(choice, dict) and choice.get("disable_parallel_tool_use") else None
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    served = {"auto": "auto", "any": "required", "none": "none"}
    if kind == "any" and not has_tools:
        raise bad_request("tool_choice.type 'any' needs tools to choose from", "tool_choice.type")
    if kind not in served:
        raise bad_request("tool_choice.type must be 'auto', 'any', 'none' or 'tool' (with a name)", "tool_choice.type")
    return chat_tool_choice(served[kind], has_tools, auto_tools), parallel


def _thinking(body: AnthropicMessagesRequest) -> tuple[str | None, int | None]:
    """thinking and output_config.effort as the chat path's reasoning_effort (as vLLM maps them:
    disabled is "none", which turns enable_thinking off) and thinking budget (an enabled
    thinking's budget_tokens, checked as Anthropic checks it)."""
    thinking, effort = body.thinking, (body.output_config or {}).get("effort")
    if effort is not None and effort not in EFFORTS:
        raise bad_request(f"output_config.effort must be one of {', '.join(EFFORTS)}", "output_config.effort")
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if thinking is not None and kind not in ("enabled", "disabled", "adaptive"):
        raise bad_request("thinking.type must be 'enabled', 'disabled' or 'adaptive'", "thinking.type")
    budget = None
    if kind == "enabled":
        budget = thinking.get("budget_tokens")
        if not isinstance(budget, int) or not MIN_THINKING_BUDGET <= budget < body.max_tokens:
            raise bad_request(
                f"thinking.budget_tokens must be an integer of at least {MIN_THINKING_BUDGET} and less than max_tokens",
                "thinking.budget_tokens",
            )
    return ("none" if kind == "disabled" else effort), budget


def _response_format(config: dict | None) -> dict | None:
    """output_config.format (a JSON schema the answer follows) as the chat's response_format, strict
    as Anthropic's structured outputs are (a schema the grammar cannot enforce whole is refused)."""
    format_ = (config or {}).get("format")
    if format_ is None:
        return None
    if not isinstance(format_, dict) or format_.get("type") != "json_schema" or "schema" not in format_:
        raise bad_request('output_config.format must be {"type": "json_schema", "schema": ...}', "output_config.format")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": format_["schema"], "strict": True}}


# ---- the answer -------------------------------------------------------------------------------


class _Blocks:
    """A message's content blocks, built from the chat deltas of MessageStreamer, with the stream's
    events: each block starts, grows by its deltas and stops before the next one starts
    (Anthropic's order). A whole message is built the same way and its events dropped."""

    def __init__(self) -> None:
        self.blocks: list[dict] = []
        self._open: dict | None = None
        self._arguments = ""  # the open tool_use block's arguments so far (JSON text)

    def feed(self, delta: dict) -> list[str]:
        if delta.get("reasoning"):
            return self._grow("thinking", delta["reasoning"])
        if delta.get("content"):
            return self._grow("text", delta["content"])
        events = []
        for call in delta.get("tool_calls", ()):
            function = call["function"]
            if "id" in call:  # a call's first delta: a new block
                events += self.close()
                events += self._start({"type": "tool_use", "id": call["id"], "name": function["name"], "input": {}})
            if function["arguments"]:  # the call's block is the open one: calls stream one after another
                self._arguments += function["arguments"]
                delta_event = {"type": "input_json_delta", "partial_json": function["arguments"]}
                events.append(_event("content_block_delta", index=len(self.blocks), delta=delta_event))
        return events

    def close(self) -> list[str]:
        """The open block done; a tool call's input parsed from its arguments ({} where they were
        cut short: the stop_reason says max_tokens)."""
        block, self._open = self._open, None
        if block is None:
            return []
        if block["type"] == "tool_use":
            block["input"] = _parsed(self._arguments)
            self._arguments = ""
        self.blocks.append(block)
        return [_event("content_block_stop", index=len(self.blocks) - 1)]

    def finish(self) -> list[str]:
        """The last block done; where the model wrote nothing, an empty text block (vLLM's: strict
        clients read content[0])."""
        empty = [] if self.blocks or self._open is not None else self._start({"type": "text", "text": ""})
        return empty + self.close()

    def _start(self, block: dict) -> list[str]:
        self._open = block
        return [_event("content_block_start", index=len(self.blocks), content_block=block)]

    def _grow(self, kind: str, text: str) -> list[str]:
        events = []
        if self._open is None or self._open["type"] != kind:
            events += self.close()
            events += self._start(
                {"type": "thinking", "thinking": "", "signature": ""}
                if kind == "thinking"
                else {"type": "text", "text": ""}
            )
        self._open[kind] += text
        delta = {"type": f"{kind}_delta", kind: text}
        return events + [_event("content_block_delta", index=len(self.blocks), delta=delta)]


def _parsed(arguments: str) -> dict:
    try:
        value = json.loads(arguments) if arguments else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _ending(blocks: _Blocks, streamer: MessageStreamer, out: SequenceOutput) -> dict:
    """stop_reason and stop_sequence, vLLM's rule: max_tokens wins; whole tool calls are
    tool_use; a matched stop string is stop_sequence; any other call tool_use; else end_turn."""
    if out.finish_reason == "length":
        reason, sequence = "max_tokens", None
    elif streamer.called:
        reason, sequence = "tool_use", None
    elif isinstance(out.stop_reason, str):
        reason, sequence = "stop_sequence", out.stop_reason
    elif any(block["type"] == "tool_use" for block in blocks.blocks):
        reason, sequence = "tool_use", None
    else:
        reason, sequence = "end_turn", None
    return {"stop_reason": reason, "stop_sequence": sequence}


def _usage(out: SequenceOutput) -> dict:
    """Anthropic's usage: input_tokens are those not read from the cache (as vLLM counts them)."""
    counts = usage([[out]])
    cached = counts["prompt_tokens_details"]["cached_tokens"]
    return {
        "input_tokens": counts["prompt_tokens"] - cached,
        "cache_read_input_tokens": cached,
        "output_tokens": counts["completion_tokens"],
    }


def _event(kind: str, **fields: Any) -> str:
    payload = {"type": kind, **fields}
    return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _error(exc: APIError) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(exc.status, "api_error"), "message": exc.message}}


class _Answer:
    """One sequence's message as its updates arrive: the chat deltas of its text in arrival order
    (so that blocks keep the order the model wrote them in), as blocks and their events."""

    def __init__(self, plan: ToolPlan) -> None:
        self.blocks, self.streamer = _Blocks(), plan.streamer()
        self.final: SequenceOutput | None = None

    async def events(self, generation: Generation) -> AsyncIterator[tuple[SequenceOutput, list[str]]]:
        """Each update, with the block events its text makes."""
        async for _, update in generation.updates():
            deltas = self.streamer.feed(update.text_delta) if update.text_delta else []
            if update.finished:
                deltas += self.streamer.finish()
                self.final = update
            yield update, [event for delta in deltas for event in self.blocks.feed(delta)]

    def ending(self) -> dict:
        assert self.final is not None, "a generation ends with a finished update"
        return _ending(self.blocks, self.streamer, self.final)


async def _events(plan: ToolPlan, generation: Generation, head: dict, prompt_tokens: int) -> AsyncIterator[str]:
    """Anthropic's stream: message_start, each block's start, deltas and stop, message_delta with
    the stop_reason and the output tokens, message_stop; where the generation fails after the
    stream began, the open block stopped and an error event."""
    answer, started = _Answer(plan), False
    try:
        async for update, events in answer.events(generation):
            if not started:
                started, cached = True, update.metrics.num_cached_tokens
                begun = {"input_tokens": prompt_tokens - cached, "cache_read_input_tokens": cached, "output_tokens": 0}
                message = {**head, "content": [], "stop_reason": None, "stop_sequence": None, "usage": begun}
                yield _event("message_start", message=message)
            for event in events:
                yield event
    except APIError as exc:
        for event in answer.blocks.close():
            yield event
        yield _event("error", error=_error(exc)["error"])
        return
    for event in answer.blocks.finish():
        yield event
    yield _event("message_delta", delta=answer.ending(), usage=_usage(answer.final))
    yield _event("message_stop")
