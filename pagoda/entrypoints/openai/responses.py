"""POST /v1/responses: OpenAI's Responses API over the chat path. A request's input items become
chat messages (its function_call items an assistant turn's tool calls, its function_call_output
items tool messages), its function tools and text.format the chat's tools and response_format;
chat.prepare checks and renders them as for /v1/chat/completions, and the chat message the model
writes comes back as output items: reasoning, message, function_call.

By default nothing is stored (as vLLM without its response store): previous_response_id is refused,
and a client sends the whole conversation each turn. With vLLM's VLLM_ENABLE_RESPONSES_API_STORE=1
the server keeps its latest responses (response_store.py): previous_response_id continues one (its
input items and output items, then the new input; not its instructions, as OpenAI's), and the
GET, DELETE and input_items routes find them. Conversations and background runs are refused."""

from __future__ import annotations

import itertools
import json
import re
import time
import typing
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagoda.entrypoints.openai import chat
from pagoda.entrypoints.openai.errors import APIError, bad_request, renamed
from pagoda.entrypoints.openai.logprobs import before_delta, chat_logprobs
from pagoda.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ReasoningEffort,
    ResponsesRequest,
    VllmResponsesFields,
)
from pagoda.entrypoints.openai.response_store import ResponseStore
from pagoda.entrypoints.openai.serving import ServerState, event_stream, usage
from pagoda.entrypoints.openai.streams import Generation
from pagoda.entrypoints.openai.tool_calls import ToolPlan
from pagoda.tools.reasoning import ReasoningTokenCounter

ENDPOINT = "/v1/responses"
LOGPROBS = "message.output_text.logprobs"  # the one `include` entry served
# the other entries vLLM takes (and OpenAI's agents SDK sends: its stateless runs ask for encrypted
# reasoning): taken, giving nothing, as vLLM gives nothing for them
INCLUDE_NOTHING = (
    "reasoning.encrypted_content",
    "code_interpreter_call.outputs",
    "computer_call_output.output.image_url",
    "file_search_call.results",
    "message.input_image.image_url",
)
INPUT_ROLES = ("user", "system", "developer", "assistant")
# what Pagoda cannot do, refused where the request sets it (None and False are unset)
NOT_SERVED = {
    "previous_response_id": "this server stores no responses (start it with VLLM_ENABLE_RESPONSES_API_STORE=1): "
    "send the whole conversation as input",
    "conversation": "this server stores no conversations: send the whole conversation as input",
    "background": "responses run in the foreground only",
    "prompt": "no stored prompt templates: send the instructions and input",
}
# a chat field's name in the chat path's 400s, and its name in a Responses request
RENAMES = (
    (re.compile(r"^tools\[(\d+)\]\.function\b"), r"tools[\1]"),
    (re.compile(r"^response_format(\.json_schema)?\b"), "text.format"),
    (re.compile(r"^max_completion_tokens\b"), "max_output_tokens"),
    (re.compile(r"^messages\b.*"), "input"),
)


async def create_response(state: ServerState, body: ResponsesRequest, http: Request) -> Response:
    store = state.response_store
    earlier, given = _conversation(store, body)  # what the response answers: earlier turns' items, then its input's
    conversation = earlier + given
    keep = None
    if store is not None and body.store:

        def keep(response: dict) -> None:  # once the response is whole: its input items were checked
            store.put(response, earlier + [_stored_item(item) for item in given])

    served = body if store is None else body.model_copy(update={"input": conversation, "previous_response_id": None})
    try:
        request = chat_request(served, state.config.tools.enable_auto_tool_choice, state.limits.max_model_len)
        prepared = await chat.prepare(state, request)
    except APIError as exc:
        raise _renamed(exc) from None
    logprobs = _logprobs(state, request, prepared.plan)
    response_id = body.request_id or f"resp_{uuid.uuid4().hex}"
    generation = await state.launch(
        http,
        ENDPOINT,
        response_id,
        [prepared.prompt_ids],
        prepared.params,
        request.cache_salt,
        request.model,
        request.priority,
    )
    head = _head(state, body, request, prepared, response_id, stored=keep is not None)
    if body.stream:
        events = _events(prepared.plan, generation, head, logprobs, state.reasoning_counter, keep)
        return event_stream(events, generation)
    out = (await state.collect(http, generation))[0][0]
    # the items as a stream of the whole text builds them: one owner of their order and shapes
    items, streamer = _Items(), prepared.plan.streamer()
    items.logprobs = logprobs(out.logprobs)
    for delta in streamer.feed(out.text) + streamer.finish():
        items.feed(delta)
    incomplete = out.finish_reason == "length" and not streamer.called
    items.finish(incomplete)
    response = _finished(head, items.items, incomplete, usage([[out]], state.reasoning_counter))
    if keep is not None:
        keep(response)
    return JSONResponse(response)


def _conversation(store: ResponseStore | None, body: ResponsesRequest) -> tuple[list[dict], list[dict]]:
    """The input items the response answers: with a store, the conversation of the response
    `previous_response_id` names (404 where it holds none); and the input's own items."""
    items = [{"type": "message", "role": "user", "content": body.input}] if isinstance(body.input, str) else body.input
    if store is None or body.previous_response_id is None:
        return [], list(items)
    earlier = store.get(body.previous_response_id)
    if earlier is None:
        raise not_stored(body.previous_response_id, "previous_response_id")
    return earlier.conversation, list(items)


def _stored_item(item: dict) -> dict:
    """An input item as OpenAI lists a stored response's input items: with an id, and a message's
    text as a list of parts (input_text, or output_text for an assistant's)."""
    kind = item.get("type", "message")
    prefix = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}[kind]
    stored = {**item, "id": item.get("id") or _item_id(prefix), "type": kind}
    if kind == "message" and isinstance(item.get("content"), str):
        part = "output_text" if item.get("role") == "assistant" else "input_text"
        stored["content"] = [{"type": part, "text": item["content"]}]
    if kind != "reasoning":
        stored.setdefault("status", "completed")
    return stored


def not_stored(response_id: str, param: str = "response_id") -> APIError:
    return APIError(404, f"Response with id {response_id!r:.100} not found", param, "response_not_found")


def chat_request(body: ResponsesRequest, auto_tools: bool, max_model_len: int) -> ChatCompletionRequest:
    """The chat request that asks for what `body` asks for; 400s name the Responses field.
    `auto_tools`: the server reads calls out of free text (--enable-auto-tool-choice); without it,
    tools with no tool_choice are shown to the model and its answer taken as text (vLLM's rule).
    truncation "auto" keeps the input's last tokens that leave room for max_output_tokens."""
    for field, reason in NOT_SERVED.items():
        if getattr(body, field) not in (None, False, []):
            raise bad_request(f"`{field}` is not supported: {reason}", field)
    if body.truncation not in (None, "disabled", "auto"):
        raise bad_request(f"truncation must be 'auto' or 'disabled', got {body.truncation!r}", "truncation")
    others = [entry for entry in body.include or [] if entry not in (LOGPROBS, *INCLUDE_NOTHING)]
    if others:
        raise bad_request(
            f"include {others[0]!r} is not supported: only {LOGPROBS!r} is (and {', '.join(INCLUDE_NOTHING)}, "
            "taken and giving nothing)",
            "include",
        )
    with_logprobs = LOGPROBS in (body.include or [])
    instructions = [] if body.instructions is None else [{"role": "system", "content": body.instructions}]
    messages = instructions + input_messages(body.input)
    # an assistant message last and marked incomplete is continued, not answered (vLLM's rule)
    last = body.input[-1] if isinstance(body.input, list) and body.input else None
    continued = isinstance(last, dict) and last.get("role") == "assistant" and last.get("status") == "incomplete"
    fields = {
        "model": body.model,
        "messages": messages,
        "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k,
        "min_p": body.min_p,
        "presence_penalty": body.presence_penalty,
        "frequency_penalty": body.frequency_penalty,
        "logit_bias": body.logit_bias,
        "seed": body.seed,
        "user": body.user,
        "tools": chat_tools(body.tools),
        "tool_choice": chat_tool_choice(body.tool_choice, bool(body.tools), auto_tools),
        "parallel_tool_calls": body.parallel_tool_calls,
        "response_format": response_format(body.text),
        "truncate_prompt_tokens": _kept(body, max_model_len) if body.truncation == "auto" else None,
        "logprobs": with_logprobs or None,
        "top_logprobs": body.top_logprobs if with_logprobs else None,
        "add_generation_prompt": False if continued else None,
        "continue_final_message": continued or None,
        "reasoning_effort": _effort(body),
        **{name: getattr(body, name) for name in VllmResponsesFields.model_fields},
    }
    return ChatCompletionRequest.model_validate({key: value for key, value in fields.items() if value is not None})


def _effort(body: ResponsesRequest) -> str | None:
    """reasoning.effort, the chat path's reasoning_effort (as vLLM maps it)."""
    effort = (body.reasoning or {}).get("effort")
    if effort is not None and effort not in typing.get_args(ReasoningEffort):
        choices = ", ".join(map(repr, typing.get_args(ReasoningEffort)))
        raise bad_request(f"reasoning.effort must be one of {choices}, got {effort!r}", "reasoning.effort")
    return effort


def _kept(body: ResponsesRequest, max_model_len: int) -> int:
    """How many of the prompt's last tokens truncation "auto" keeps (-1: all but one of the context,
    as vLLM keeps without max_output_tokens)."""
    if body.max_output_tokens is None or not 0 < body.max_output_tokens < max_model_len:
        return -1
    return max_model_len - body.max_output_tokens


def input_messages(input_: str | list[Any]) -> list[dict]:
    """Input items as chat messages: a string is one user message; function_call items join the
    assistant turn before them (or start one), function_call_output items answer a call (made
    earlier, or trimmed from the history); reasoning items are dropped (chat templates show no
    earlier turn's reasoning)."""
    if isinstance(input_, str):
        return [{"role": "user", "content": input_}]
    messages: list[dict] = []
    for i, item in enumerate(input_):
        param = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{param} must be an object: a message, function_call or function_call_output", param)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in INPUT_ROLES:
                raise bad_request(
                    f"{param}.role must be one of {', '.join(INPUT_ROLES)}, got {role!r}", f"{param}.role"
                )
            content = chat.text_content(item.get("content"), f"{param}.content")
            messages.append({"role": role, "content": content})
        elif kind == "function_call":
            call = _call(item, param)
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":  # its call may be gone from a trimmed history, as in chat
            call_id = _string(item, "call_id", param)
            output = chat.text_content(item.get("output"), f"{param}.output")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
        elif kind != "reasoning":
            raise bad_request(
                f"{param}.type {kind!r} is not supported: this server takes message, function_call, "
                "function_call_output and reasoning items",
                f"{param}.type",
            )
    if not messages:
        raise bad_request("input holds no message", "input")
    return messages


def _string(item: dict, key: str, param: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise bad_request(f"{param}.{key} must be a non-empty string", f"{param}.{key}")
    return value


def _call(item: dict, param: str) -> dict:
    """A function_call item as a chat tool call (its arguments as sent: chat.parse_messages reads them)."""
    arguments = item.get("arguments", "")
    if not isinstance(arguments, str):
        raise bad_request(f"{param}.arguments must be a string of JSON", f"{param}.arguments")
    name = _string(item, "name", param)
    return {
        "id": _string(item, "call_id", param),
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def chat_tools(tools: list[Any] | None) -> list[dict] | None:
    """Function tools in the chat's shape ({"type": "function", "function": {...}}); the chat path
    checks their names and schemas."""
    if not tools:
        return None
    functions = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise bad_request(
                f"tools[{i}].type {kind!r} is not supported: this server takes function tools only and runs no "
                "built-in tools",
                f"tools[{i}].type",
            )
        function = {key: tool[key] for key in ("name", "description", "parameters", "strict") if key in tool}
        functions.append({"type": "function", "function": function})
    return functions


def chat_tool_choice(choice: Any, has_tools: bool, auto_tools: bool) -> Any:
    if not has_tools and choice in (None, "auto", "none"):
        return None  # OpenAI's default "auto" with no tools: nothing to choose
    if choice is None:
        return None if auto_tools else "none"
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":  # the chat shape of the same
        listed = choice.get("tools") if isinstance(choice.get("tools"), list) else []
        functions = [{"type": "function", "function": {"name": t.get("name")}} for t in listed if isinstance(t, dict)]
        return {"type": "allowed_tools", "allowed_tools": {"mode": choice.get("mode"), "tools": functions}}
    raise bad_request(
        "tool_choice must be 'auto', 'none', 'required', {\"type\": \"function\", \"name\": ...} or "
        '{"type": "allowed_tools", "mode": ..., "tools": [...]}',
        "tool_choice",
    )


def response_format(text: dict[str, Any] | None) -> dict | None:
    """text.format as the chat's response_format: json_schema's fields move into its json_schema."""
    format_ = (text or {}).get("format")
    if format_ is None:
        return None
    kind = format_.get("type") if isinstance(format_, dict) else None
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        fields = {key: format_[key] for key in ("name", "schema", "strict", "description") if key in format_}
        return {"type": "json_schema", "json_schema": fields}
    shown = kind if isinstance(format_, dict) else format_
    raise bad_request(
        f"text.format.type must be 'text', 'json_object' or 'json_schema', got {shown!r}", "text.format.type"
    )


def _renamed(exc: APIError) -> APIError:
    """The chat path's 400 with its field named as the Responses request names it."""
    for pattern, name in RENAMES:
        if exc.param is not None and pattern.match(exc.param):
            return renamed(exc, pattern.sub(name, exc.param))
    return exc


def _logprobs(state: ServerState, request: ChatCompletionRequest, plan: ToolPlan) -> Callable[..., list[dict]]:
    """Tokens' engine logprobs as output_text's logprobs (chat's entries: token, logprob, bytes,
    top_logprobs), given the entries before them when streaming; none unless `include` asks for
    them, and none that would show reasoning left out."""
    if not plan.shows_per_token(bool(request.logprobs)):
        return lambda logprobs, before=(): []
    names = state.logprob_tokens(request)
    return lambda logprobs, before=(): chat_logprobs(names, logprobs or [], request.top_logprobs or 0, before)[
        "content"
    ]


def _head(
    state: ServerState,
    body: ResponsesRequest,
    request: ChatCompletionRequest,
    prepared: chat.PreparedChat,
    response_id: str,
    stored: bool,
) -> dict:
    """The response object's fields that do not depend on the output."""
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "status": "in_progress",
        "background": False,
        "error": None,
        "incomplete_details": None,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "max_tool_calls": body.max_tool_calls,
        "metadata": body.metadata or {},
        "model": state.answering_model(body.model),
        "output": [],
        "parallel_tool_calls": body.parallel_tool_calls,
        "previous_response_id": body.previous_response_id,
        "reasoning": body.reasoning,
        "store": stored,
        "temperature": prepared.params.temperature,
        "text": body.text or {"format": {"type": "text"}},
        "tool_choice": _served_choice(body, request),
        "tools": body.tools or [],
        "top_logprobs": body.top_logprobs,
        "top_p": prepared.params.top_p,
        "truncation": body.truncation or "disabled",
        "usage": None,
        "user": body.user,
    }


def _served_choice(body: ResponsesRequest, request: ChatCompletionRequest) -> Any:
    """The tool_choice the request was served with, in the Responses shape: as sent where it named
    one with tools; else "none" without tools or where the server read no calls, "auto" otherwise."""
    if not body.tools or request.tool_choice == "none":
        return "none"
    return body.tool_choice if body.tool_choice is not None else "auto"


def _finished(head: dict, items: list[dict], incomplete: bool, counts: dict) -> dict:
    return {
        **head,
        "status": "incomplete" if incomplete else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "output": items,
        "usage": {
            "input_tokens": counts["prompt_tokens"],
            "input_tokens_details": counts["prompt_tokens_details"],
            "output_tokens": counts["completion_tokens"],
            "output_tokens_details": {
                "reasoning_tokens": counts.get("completion_tokens_details", {}).get("reasoning_tokens", 0)
            },
            "total_tokens": counts["total_tokens"],
        },
    }


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _reasoning_item(text: str) -> dict:
    return {
        "type": "reasoning",
        "id": _item_id("rs"),
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": "completed",
    }


def _message_item(text: str, incomplete: bool, logprobs: list[dict] | None = None) -> dict:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}
    return {
        "type": "message",
        "id": _item_id("msg"),
        "status": "incomplete" if incomplete else "completed",
        "role": "assistant",
        "content": [part],
    }


def _call_item(call_id: str, name: str, arguments: str) -> dict:
    return {
        "type": "function_call",
        "id": _item_id("fc"),
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": "completed",
    }


class _Items:
    """A response's output items, built from the chat deltas of MessageStreamer, with the stream's
    events: each item is added, grows by its deltas and is done before the next one is added
    (OpenAI's event order). A whole response is built the same way and its events dropped, so that
    it has the items a stream would have."""

    def __init__(self) -> None:
        self.items: list[dict] = []  # done, in output order
        self.logprobs: list[dict] = []  # of tokens whose text no message delta has carried yet
        self._open: dict | None = None
        self._sequence = itertools.count()

    def event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": next(self._sequence), **fields}
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"

    def feed(self, delta: dict) -> list[str]:
        if delta.get("reasoning"):
            return self._grow("reasoning", delta["reasoning"])
        if delta.get("content"):
            return self._grow("message", delta["content"])
        events = []
        for call in delta.get("tool_calls", ()):
            function = call["function"]
            if "id" in call:  # a call's first delta: a new item
                events += self.close() + self._add(_call_item(call["id"], function["name"], ""))
            if function["arguments"]:  # the call's item is the open one: calls stream one after another
                item = self._open
                item["arguments"] += function["arguments"]
                where = {"item_id": item["id"], "output_index": len(self.items)}
                events.append(
                    self.event("response.function_call_arguments.delta", **where, delta=function["arguments"])
                )
        return events

    def close(self, incomplete: bool = False) -> list[str]:
        """The open item done (as cut short where `incomplete`). A message keeps the logprobs still
        pending, of tokens whose text came with no delta of its own (the end-of-sequence token)."""
        item, self._open = self._open, None
        if item is None:
            return []
        where = {"item_id": item["id"], "output_index": len(self.items)}
        events = []
        if item["type"] == "function_call":
            events.append(
                self.event(
                    "response.function_call_arguments.done", **where, name=item["name"], arguments=item["arguments"]
                )
            )
        else:
            part = item["content"][0]
            if item["type"] == "message":
                part["logprobs"] += self.logprobs
                self.logprobs = []
            kind = "response.output_text.done" if item["type"] == "message" else "response.reasoning_text.done"
            extra = {"logprobs": part["logprobs"]} if item["type"] == "message" else {}
            events.append(self.event(kind, **where, content_index=0, text=part["text"], **extra))
            events.append(self.event("response.content_part.done", **where, content_index=0, part=part))
        item["status"] = "incomplete" if incomplete else "completed"  # a call cut short too: not to be run
        self.items.append(item)
        return events + [self.event("response.output_item.done", output_index=where["output_index"], item=item)]

    def finish(self, incomplete: bool) -> list[str]:
        """The last item done (as cut short where `incomplete`); where the model wrote nothing, an
        empty message first."""
        empty = [] if self.items or self._open is not None else self._add(_message_item("", False))
        return empty + self.close(incomplete)

    def _add(self, item: dict) -> list[str]:
        item["status"] = "in_progress"
        self._open = item
        if item["type"] == "function_call":
            return [self.event("response.output_item.added", output_index=len(self.items), item=item)]
        added = self.event("response.output_item.added", output_index=len(self.items), item={**item, "content": []})
        where = {"item_id": item["id"], "output_index": len(self.items), "content_index": 0}
        return [added, self.event("response.content_part.added", **where, part={**item["content"][0], "text": ""})]

    def _grow(self, kind: str, text: str) -> list[str]:
        """Text of a reasoning or message item: the open one, or a new one after closing another."""
        events = []
        if self._open is None or self._open["type"] != kind:
            events += self.close()
            new = _reasoning_item("") if kind == "reasoning" else _message_item("", False)
            events += self._add(new)
        item = self._open
        where = {"item_id": item["id"], "output_index": len(self.items)}
        item["content"][0]["text"] += text
        if kind == "message":
            logprobs, self.logprobs = self.logprobs, []
            item["content"][0]["logprobs"] += logprobs
            return events + [
                self.event("response.output_text.delta", **where, content_index=0, delta=text, logprobs=logprobs)
            ]
        return events + [self.event("response.reasoning_text.delta", **where, content_index=0, delta=text)]


async def _events(
    plan: ToolPlan,
    generation: Generation,
    head: dict,
    logprobs: Callable[..., list[dict]],
    reasoning_counter: ReasoningTokenCounter | None,
    keep: Callable[[dict], None] | None = None,
) -> AsyncIterator[str]:
    """OpenAI's stream of response events: created, in_progress, each output item's events, then
    completed with the whole response (or, where the generation fails, error and failed).
    `reasoning_counter` counts the usage's reasoning tokens (a server with a reasoning parser);
    `keep` stores the whole response (a failed one is not stored)."""
    items, streamer = _Items(), plan.streamer()
    yield items.event("response.created", response=head)
    yield items.event("response.in_progress", response=head)
    final = None
    try:
        async for _, update in generation.updates():
            items.logprobs += logprobs(update.logprobs_delta, before_delta(update.logprobs, update.logprobs_delta))
            deltas = streamer.feed(update.text_delta) if update.text_delta else []
            if update.finished:
                deltas += streamer.finish()
                final = update
            for delta in deltas:
                for event in items.feed(delta):
                    yield event
    except APIError as exc:  # after the stream began (the server shutting down, the engine failed)
        # OpenAI's failure events, not chat's error chunk: the text held back and the open item done
        # as cut short, an error event, then response.failed with the items so far as the last event.
        # The error event nests its fields too, as OpenAI's does: the openai client raises on it.
        for delta in streamer.finish():
            for event in items.feed(delta):
                yield event
        for event in items.close(incomplete=True):
            yield event
        code = exc.code or exc.type
        yield items.event("error", code=code, message=exc.message, param=exc.param, error=exc.body()["error"])
        failed = {**head, "status": "failed", "error": {"code": code, "message": exc.message}, "output": items.items}
        yield items.event("response.failed", response=failed)
        return
    incomplete = final is not None and final.finish_reason == "length" and not streamer.called
    for event in items.finish(incomplete):
        yield event
    counts = usage([[final]] if final is not None else [], reasoning_counter)
    response = _finished(head, items.items, incomplete, counts)
    if keep is not None:
        keep(response)
    # response.completed however it ended (its status says incomplete), as vLLM sends it: the
    # openai client's stream helper takes its final response from that event only
    yield items.event("response.completed", response=response)
