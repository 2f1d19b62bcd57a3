"""POST /v1/chat/completions: messages -> chat template -> one engine request (n sequences)."""

from __future__ import annotations

import dataclasses
import inspect
import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

import jinja2
import jinja2.sandbox
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagoda.config import ConfigError
from pagoda.engine.outputs import SequenceOutput
from pagoda.entrypoints.openai.errors import bad_request
from pagoda.entrypoints.openai.logprobs import before_delta, chat_logprobs, vllm_prompt_logprobs
from pagoda.entrypoints.openai.params import check_context, constraint_field, sampling_params, truncated
from pagoda.entrypoints.openai.protocol import ChatCompletionRequest, EmbeddingRequest, TokenizeRequest
from pagoda.entrypoints.openai.serving import (
    DONE,
    LONG_PROMPT_CHARS,
    FinishedGeneration,
    ServerState,
    answer_id,
    beam_search_params,
    chunk_usage,
    event_stream,
    sse,
    usage,
)
from pagoda.entrypoints.openai.streams import Generation
from pagoda.entrypoints.openai.tool_calls import ToolPlan, check_tools, plan_tools
from pagoda.model_files import (
    apply_chat_template,
    template_iterates_content,
    template_names_developer,
    template_supports_tools,
)
from pagoda.sampling_params import SamplingParams, StructuredOutputsParams
from pagoda.tools.prompt import with_tools_in_system_prompt
from pagoda.tools.tags import answer_format

ENDPOINT = "/v1/chat/completions"
ROLES = ("system", "developer", "user", "assistant", "tool")


class TextParts(str):
    """A message's text parts joined by newlines, the content a chat template sees in vLLM's "string"
    format, holding the parts themselves for its "openai" format (`with_content_parts`)."""

    parts: tuple[str, ...]

    def __new__(cls, parts: Sequence[str]) -> TextParts:
        text = super().__new__(cls, "\n".join(parts))
        text.parts = tuple(parts)
        return text

    def __getnewargs__(self) -> tuple[tuple[str, ...]]:  # copy and pickle build it from its parts
        return (self.parts,)


def parse_messages(messages: list[dict]) -> list[dict]:
    """Messages checked, in vLLM's shapes: text parts are joined (`TextParts`; no content is none),
    a message's `name` kept, assistant tool calls carry their arguments parsed into a dict
    (templates iterate them or `| tojson` them), a tool result names the call it answers (which a
    history trimmed by a framework may have dropped: vLLM takes it), and a role of the template's
    own (Llama's `ipython`) passes as it is. `render_ids` does the rest as vLLM's renderer does."""
    parsed: list[dict] = []
    for i, message in enumerate(messages):
        role = _role(message, i)
        if role == "tool":
            parsed.append(_tool_result(message, i))
            continue
        entry = {"role": role, "content": _content(message, i)}
        if role == "assistant" and message.get("tool_calls") is not None:
            entry["tool_calls"] = _tool_calls(message["tool_calls"], f"messages[{i}].tool_calls")
        parsed.append(entry | _name(message, i))
    return parsed


def _role(message: dict, i: int) -> str:
    """A message's role: OpenAI's (ROLES), or any other a chat template may know, as vLLM passes them."""
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise bad_request(
            f"messages[{i}].role must be one of {', '.join(ROLES)} (or another role the chat template knows), "
            f"got {role!r}",
            f"messages[{i}].role",
        )
    return role


def _content(message: dict, i: int) -> str:
    content = message.get("content")
    return TextParts(()) if content is None else text_content(content, f"messages[{i}].content")


def _name(message: dict, i: int) -> dict:
    """A message's `name` (a participant's, a tool's), kept for the template, as vLLM keeps it."""
    name = message.get("name")
    if name is not None and not isinstance(name, str):
        raise bad_request(f"messages[{i}].name must be a string", f"messages[{i}].name")
    return {"name": name} if name else {}


# The content parts that hold text, and the key that holds it, as vLLM reads them: chat's text, the
# Responses API's input_text and output_text, and an assistant's refusal (OpenAI's, in a replayed turn)
TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}


def text_content(content: object, param: str) -> str:
    """A message's content: a string, or text parts (TEXT_PARTS) joined by newlines (`TextParts`)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{param} must be a string or a list of text parts", param)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        key = TEXT_PARTS.get(kind) if isinstance(kind, str) else None
        if key is None:
            raise bad_request(
                f"{param}[{j}].type {kind!r} is not supported: this server takes text parts only "
                f"({', '.join(TEXT_PARTS)})",
                f"{param}[{j}].type",
            )
        if not isinstance(part.get(key), str):
            raise bad_request(f"{param}[{j}].{key} must be a string", f"{param}[{j}].{key}")
        texts.append(part[key])
    return TextParts(texts)


def _tool_calls(calls: object, param: str) -> list[dict]:
    if not isinstance(calls, list):
        raise bad_request(f"{param} must be a list of tool calls", param)
    return [_tool_call(call, f"{param}[{j}]") for j, call in enumerate(calls)]


def _tool_call(call: object, param: str) -> dict:
    if not isinstance(call, dict):
        raise bad_request(f"{param} must be an object with id, type and function", param)
    if not isinstance(call.get("id"), str) or not call["id"]:
        raise bad_request(f"{param}.id must be a non-empty string", f"{param}.id")
    if call.get("type", "function") != "function":
        raise bad_request(f"{param}.type must be 'function', got {call['type']!r}", f"{param}.type")
    function = call.get("function")
    if not isinstance(function, dict):
        raise bad_request(f"{param}.function must be an object with name and arguments", f"{param}.function")
    if not isinstance(function.get("name"), str) or not function["name"]:
        raise bad_request(f"{param}.function.name must be a non-empty string", f"{param}.function.name")
    arguments = _arguments(function.get("arguments"))
    return {"type": "function", "id": call["id"], "function": {"name": function["name"], "arguments": arguments}}


def _arguments(arguments: object) -> dict:
    """A call's arguments as chat templates take them, a mapping: its JSON object, parsed; anything
    else ({} then: none, an empty string, a call cut short as this server returns one at max_tokens,
    JSON that is no object) does not refuse the turn, since it stays in every later turn's history
    (vLLM's rule)."""
    if isinstance(arguments, dict):
        return arguments
    try:
        parsed = json.loads(arguments) if isinstance(arguments, str) else None
    except (json.JSONDecodeError, RecursionError):
        parsed = None
    return parsed if isinstance(parsed, dict) else {}


def _tool_result(message: dict, i: int) -> dict:
    param = f"messages[{i}].tool_call_id"
    call_id = message.get("tool_call_id")
    if not isinstance(call_id, str):
        raise bad_request(f"{param} is required: the id of the tool call this message answers", param)
    return {"role": "tool", "content": _content(message, i), "tool_call_id": call_id} | _name(message, i)


def renderer_arguments(apply_chat_template) -> set[str]:
    """The names a renderer call takes as its own arguments (tokenize, chat_template, tools, ..),
    which chat template variables must not be named."""
    return {"messages", "conversation", "conversations", *inspect.signature(apply_chat_template).parameters}


def checked_template_kwargs(
    tokenizer, body: ChatCompletionRequest | TokenizeRequest | EmbeddingRequest, defaults: dict | None = None
) -> dict:
    """The renderer's keywords for the request: its chat_template_kwargs over the server's
    `defaults` (--default-chat-template-kwargs), whose names of the renderer's own arguments
    (tokenize, chat_template, ...) are refused, as they would change the call, not what the
    template sees; and vLLM's add_generation_prompt and continue_final_message."""
    kwargs = body.chat_template_kwargs or {}
    own = renderer_arguments(tokenizer.apply_chat_template)
    for name in kwargs:
        if name in own:
            param = f"chat_template_kwargs.{name}"
            raise bad_request(f"{param}: {name!r} is an argument of the renderer, not a template variable", param)
    if body.add_generation_prompt and body.continue_final_message:
        raise bad_request(
            "continue_final_message and add_generation_prompt cannot both be true (set add_generation_prompt "
            "to false to continue the last message)",
            "continue_final_message",
        )
    return {
        **(defaults or {}),
        **kwargs,
        "add_generation_prompt": body.add_generation_prompt,
        "continue_final_message": body.continue_final_message,
    }


def render_ids(
    tokenizer,
    messages: list[dict],
    chat_template: str | None = None,
    tools: list[dict] | None = None,
    template_kwargs: dict | None = None,
    content_format: str = "auto",
) -> list[int]:
    """Parsed messages rendered as vLLM's renderer renders them: `developer` messages become one
    system message, first, where the template has no developer role of its own; templates that read
    `tools` get the tools and the tool turns as they are, others both as text in the generic format
    (pagoda.tools.prompt); content in `content_format` (model_files.CONTENT_FORMATS)."""
    template = chat_template or tokenizer.chat_template
    if not template_names_developer(template):
        messages = developer_as_system(messages)
    if not template_supports_tools(template):
        messages, tools = with_tools_in_system_prompt(messages, tools), None
    if content_format == "openai" or (content_format == "auto" and template_iterates_content(template)):
        messages = with_content_parts(messages)
    return apply_chat_template(tokenizer, messages, template, tools=tools, **(template_kwargs or {}))


def developer_as_system(messages: list[dict]) -> list[dict]:
    """vLLM's rule where a template has no developer role: developer messages become system ones, and
    where that leaves a system message past the first place, all of them become one, first, their
    non-empty texts joined by blank lines."""
    if not any(m["role"] == "developer" for m in messages):
        return messages
    converted = [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]
    systems = [i for i, m in enumerate(converted) if m["role"] == "system"]
    if systems == [0]:
        return converted
    text = "\n\n".join(converted[i]["content"] for i in systems if converted[i]["content"])
    return [{"role": "system", "content": text}, *(m for m in converted if m["role"] != "system")]


def with_content_parts(messages: list[dict]) -> list[dict]:
    """vLLM's "openai" content format: a message's content as its list of text parts (a string is
    one part, a call's missing content none); a tool result's stays a string, as vLLM leaves it."""

    def parts(content: str) -> list[dict]:
        texts = content.parts if isinstance(content, TextParts) else (content,)
        return [{"type": "text", "text": text} for text in texts]

    return [m if m["role"] == "tool" else {**m, "content": parts(m["content"])} for m in messages]


def request_template(
    state: ServerState, body: ChatCompletionRequest | TokenizeRequest | EmbeddingRequest
) -> str | None:
    """The chat template a request renders with: its own `chat_template` where the server trusts
    requests' (vLLM's --trust-request-chat-template; else a 400, as vLLM), else --chat-template's,
    else the model's."""
    if body.chat_template is None:
        return state.config.chat_template or state.tokenizer.chat_template
    if not state.config.trust_request_chat_template:
        raise bad_request(
            "chat_template: a request's own chat template is refused unless the server runs with "
            "--trust-request-chat-template",
            "chat_template",
        )
    return body.chat_template


def render(
    state: ServerState,
    template: str | None,
    messages: list[dict],
    tools: list[dict] | None = None,
    template_kwargs: dict | None = None,
) -> list[int]:
    """`render_checked` with the server's tokenizer and content format."""
    content_format = state.config.chat_template_content_format
    return render_checked(state.tokenizer, messages, template, tools, template_kwargs, content_format)


def render_checked(
    tokenizer,
    messages: list[dict],
    template: str | None,
    tools: list[dict] | None,
    template_kwargs: dict | None,
    content_format: str,
) -> list[int]:
    """`render_ids` with its refusals as 400s: a template that does not parse or reaches outside the
    sandbox names `chat_template` (a request's own, as the server's was checked at startup), one
    that refuses the messages names them, and so does an error the template's code raises on them
    (`'a' + [..]`, `1 // 0`)."""
    try:
        return render_ids(tokenizer, messages, template, tools, template_kwargs, content_format)
    except (jinja2.TemplateSyntaxError, jinja2.sandbox.SecurityError) as exc:
        raise bad_request(f"The chat template is refused: {exc}", "chat_template") from None
    except (ConfigError, ValueError, jinja2.TemplateError) as exc:  # ValueError: transformers' own refusals
        raise bad_request(f"The chat template cannot render these messages: {exc}", "messages") from None
    except (ArithmeticError, LookupError, TypeError, AttributeError, RecursionError) as exc:  # the template's code
        parts = content_format == "openai"
        hint = " (the openai content format gives it each message's content as a list)" if parts else ""
        raise bad_request(
            f"The chat template failed on these messages: {type(exc).__name__}: {exc}{hint}", "messages"
        ) from None


def _reply_role(state: ServerState, body: ChatCompletionRequest) -> str:
    """vLLM's rule: --response-role (assistant) after a generation prompt, else the role of the
    last message as sent (a developer message's too), which the reply continues."""
    return state.config.response_role if body.add_generation_prompt else body.messages[-1]["role"]


def _echoed(body: ChatCompletionRequest, messages: list[dict], role: str) -> str:
    """vLLM's chat echo: the last message's content, where that message has the reply's role, else
    nothing."""
    if not body.echo:
        return ""
    return messages[-1]["content"] if body.messages[-1]["role"] == role else ""  # the role as sent


@dataclasses.dataclass(frozen=True)
class PreparedChat:
    """A chat request checked and rendered, ready for the engine."""

    plan: ToolPlan
    prompt_ids: list[int]
    params: SamplingParams
    role: str  # the reply's
    echoed: str  # the text the reply starts with (vLLM's echo)


def _template_extras(body: ChatCompletionRequest) -> dict[str, Any]:
    """vLLM's documents and reasoning_effort as template variables (over chat_template_kwargs');
    reasoning_effort also turns enable_thinking on ("none": off) unless chat_template_kwargs sets it."""
    extras: dict[str, Any] = {"documents": body.documents, "reasoning_effort": body.reasoning_effort}
    if body.reasoning_effort is not None and "enable_thinking" not in (body.chat_template_kwargs or {}):
        extras["enable_thinking"] = body.reasoning_effort != "none"
    return {name: value for name, value in extras.items() if value is not None}


def template_inputs(
    tokenizer, body: ChatCompletionRequest, defaults: dict | None = None
) -> tuple[list[dict], list[dict] | None, dict]:
    """What the chat template renders for a request: its messages parsed, its tools checked (what
    plan_tools serves them as), its template variables over the server's `defaults`."""
    messages = parse_messages(body.messages)
    kwargs = {**checked_template_kwargs(tokenizer, body, defaults), **_template_extras(body)}
    return messages, check_tools(body.tools) or None, kwargs


async def render_body_messages(state: ServerState, body: TokenizeRequest | EmbeddingRequest) -> list[int]:
    """The `messages` of a /tokenize or /v1/embeddings request rendered as a chat request's are
    (its tools, template and template variables too), with the tokenizer's special tokens on top
    where `add_special_tokens` asks for them (vLLM's; default: the template's alone)."""
    messages = parse_messages(body.messages)
    tools = check_tools(body.tools) or None
    kwargs = checked_template_kwargs(state.tokenizer, body, state.config.default_template_kwargs)
    kwargs["add_special_tokens"] = bool(body.add_special_tokens)
    size = sum(len(m["content"]) for m in messages)
    template = request_template(state, body)
    size = size if body.chat_template is None else LONG_PROMPT_CHARS  # a request's template: off the loop
    return await state.off_loop(render, state, template, messages, tools, kwargs, size=size)


async def prepare(state: ServerState, body: ChatCompletionRequest) -> PreparedChat:
    """Every check of a chat request (400s name the field), its prompt rendered and its sampling
    parameters, its output constraint compiled."""
    state.check_request(body)
    if body.top_logprobs not in (None, 0) and not body.logprobs:  # 0 without logprobs: harmless, as vLLM
        raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
    messages, _, kwargs = template_inputs(state.tokenizer, body, state.config.default_template_kwargs)
    size = sum(len(m["content"]) for m in messages)
    template = request_template(state, body)
    plan = plan_tools(
        body.tools,
        body.tool_choice,
        body.parallel_tool_calls,
        state.config.tools,
        template,
        body.include_reasoning,
    )
    role = _reply_role(state, body)
    echoed = _echoed(body, messages, role)
    size = size if body.chat_template is None else LONG_PROMPT_CHARS  # a request's template: off the loop
    prompt_ids = await state.off_loop(render, state, template, messages, plan.tools, kwargs, size=size)
    prompt_ids = truncated(prompt_ids, body.truncate_prompt_tokens, body.truncation_side, state.limits.max_model_len)
    max_param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    model_default = state.limits.generation_defaults.get("max_tokens")  # generation_config's max_new_tokens
    room = state.limits.max_model_len - len(prompt_ids)
    if max_tokens is None and model_default is not None and room > 0:  # as vLLM: within the context left
        max_tokens = min(model_default, room)
    params = sampling_params(
        body,
        state.limits,
        max_tokens=max_tokens,
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        prompt_logprobs=body.prompt_logprobs,
        renames={"logprobs": "top_logprobs", "max_tokens": max_param},
        reasoning=state.reasoning,
    )
    params, plan, parts, field = planned(params, plan, constraint_field(body))
    check_context(len(prompt_ids), max_tokens, state.limits.max_model_len, "messages", max_param, body.min_tokens or 0)
    await state.check_constraint(body, params, parts, field)
    return PreparedChat(plan, prompt_ids, params, role, echoed)


def planned(
    params: SamplingParams, plan: ToolPlan, own_field: str | None
) -> tuple[SamplingParams, ToolPlan, list[tuple[str, StructuredOutputsParams]], str | None]:
    """A request's sampling as its tools change it (vLLM's rules); its plan, whose parser reads held
    calls as they come where a grammar holds them within free text; the parts of its constraint the server compiles
    alone too, each named by its field; and the field that names the whole
    (ServerState.check_constraint): a forced call's grammar replaces any other constraint (the
    request's own, in `own_field`); under "auto", calls a grammar holds (plan.held) go in a
    structural tag, either within free text or, beside the request's own constraint (vLLM's rule:
    where a strict tool, allowed_tools or --tool-strict-level holds them), as the alternative to the
    answer (a call first, or the answer as the constraint allows it); with a reasoning parser any
    constraint applies after the thinking, also where include_reasoning false leaves it out of the
    answer. A parser whose markers may be special tokens (Mistral's `[TOOL_CALLS]`, some Hermes
    models' `<tool_call>`) gets them in the text, skip_special_tokens off."""
    parts = [
        (f"tools[{i}].function.parameters", StructuredOutputsParams(json=schema, strict=strict))
        for i, schema, strict in plan.enforced
    ]
    own, held = params.structured_outputs, plan.held
    answer = answer_format(own) if own is not None and held is not None and held.beside_answer else None
    if plan.constraint is not None:
        params, field = dataclasses.replace(params, structured_outputs=plan.constraint), "tools"
    elif held is not None and (own is None or answer is not None):
        format_ = held.within_text()
        if answer is not None:
            format_ = held.or_answer(answer)
            parts.append((own_field or "response_format", own))
        tag = StructuredOutputsParams(structural_tag={"type": "structural_tag", "format": format_})
        params, field = dataclasses.replace(params, structured_outputs=tag), "tools"
        if answer is None:  # beside an answer, one that looks like calls is read whole, as any output
            plan = dataclasses.replace(plan, parser=held.read_by())
    else:
        parts, field = [], own_field
    if plan.parser is not None and plan.parser.keeps_special_tokens:
        params = dataclasses.replace(params, skip_special_tokens=False)
    return params, plan, parts, field


async def create_chat_completion(state: ServerState, body: ChatCompletionRequest, http: Request) -> Response:
    chat = await prepare(state, body)
    request_id = answer_id(http, "chatcmpl-", body.request_id)
    head = state.answer_head(request_id, "chat.completion", body.model)
    reply = (chat.role, chat.echoed)
    if body.use_beam_search:
        search = beam_search_params(body, chat.params)
        beams = await state.beam_search(
            http, ENDPOINT, request_id, [chat.prompt_ids], search, body.cache_salt, body.model, body.top_logprobs or 0
        )
        if body.stream:  # the finished beams, as vLLM streams them
            whole = FinishedGeneration(beams)
            return event_stream(_chunks(state, body, chat.plan, whole, head, chat.prompt_ids, reply), whole)
        return JSONResponse(_response(state, body, chat.plan, head, chat.prompt_ids, beams[0], reply))
    generation = await state.launch(
        http, ENDPOINT, request_id, [chat.prompt_ids], chat.params, body.cache_salt, body.model, body.priority
    )
    if body.stream:
        return event_stream(_chunks(state, body, chat.plan, generation, head, chat.prompt_ids, reply), generation)
    outputs = (await state.collect(http, generation))[0]
    return JSONResponse(_response(state, body, chat.plan, head, chat.prompt_ids, outputs, reply))


def _response(
    state: ServerState,
    body: ChatCompletionRequest,
    plan: ToolPlan,
    head: dict,
    prompt_ids: list[int],
    outputs: list[SequenceOutput],
    reply: tuple[str, str],
) -> dict:
    """`reply`: the reply's role and the echoed text it starts with."""
    role, echoed = reply
    choices = []
    for out in outputs:
        message, called = plan.message(out.text)
        message["role"] = role
        if echoed:
            message["content"] = echoed + (message["content"] or "")
        choices.append(
            {
                "index": out.index,
                "message": message,
                "logprobs": chat_logprobs(state.logprob_tokens(body), out.logprobs, body.top_logprobs or 0)
                if plan.shows_per_token(body.logprobs)
                else None,
                "finish_reason": plan.finish_reason(called, out.finish_reason),
                "stop_reason": out.stop_reason,
            }
        )
    response = {**head, "choices": choices, "usage": usage([outputs], state.reasoning_counter)}
    if body.return_token_ids:
        for choice, out in zip(choices, outputs):
            choice["token_ids"] = out.token_ids if plan.shows_per_token(True) else None
        response["prompt_token_ids"] = prompt_ids
    if body.prompt_logprobs is not None:
        response["prompt_logprobs"] = vllm_prompt_logprobs(state.token_texts, prompt_ids, outputs[0].prompt_logprobs)
    return response


async def _chunks(
    state: ServerState,
    body: ChatCompletionRequest,
    plan: ToolPlan,
    generation: Generation | FinishedGeneration,
    head: dict,
    prompt_token_ids: list[int],
    reply: tuple[str, str],
) -> AsyncIterator[str]:
    """OpenAI's chunk sequence per choice: the role with empty content, then content, reasoning
    and tool-call deltas (a call's first delta carries its id and name, the next ones fragments of
    its arguments), a chunk with only finish_reason; then the usage chunk (choices []) when asked,
    then [DONE]."""
    role, echoed = reply
    usage_of = chunk_usage(body, state.reasoning_counter, state.config.force_include_usage)
    base = {**head, "object": "chat.completion.chunk"}
    logprobs_shown, ids_shown = plan.shows_per_token(body.logprobs), plan.shows_per_token(body.return_token_ids)
    prompt_tokens = len(prompt_token_ids)

    def chunk(choice: dict, update: SequenceOutput | None = None, extra: dict | None = None) -> str:
        shown = {} if usage_of is None else {"usage": usage_of(prompt_tokens, update)}
        return sse({**base, "choices": [choice], **shown, **(extra or {})})

    # return_token_ids: the prompt's ids with each choice's first chunk, then each update's new ids
    # with the first chunk it sends (one is sent for every update that brings tokens)
    prompt_ids = {"prompt_token_ids": prompt_token_ids} if body.return_token_ids else None
    for index in range(body.n):
        yield chunk(
            {"index": index, "delta": {"role": role, "content": ""}, "logprobs": None, "finish_reason": None},
            extra=prompt_ids,
        )
    if echoed:  # then the echoed message, before anything generated
        for index in range(body.n):
            yield chunk({"index": index, "delta": {"content": echoed}, "logprobs": None, "finish_reason": None})
    final: dict[int, SequenceOutput] = {}
    streamers = [plan.streamer() for _ in range(body.n)]
    async for _, update in generation.updates():
        streamer = streamers[update.index]
        deltas = streamer.feed(update.text_delta) if update.text_delta else []
        if update.finished:
            deltas += streamer.finish()
        if (logprobs_shown or ids_shown) and update.token_ids_delta and not deltas:
            deltas = [{"content": ""}]  # the logprobs or ids of tokens whose text is held back
        for j, delta in enumerate(deltas):
            logprobs = (
                chat_logprobs(
                    state.logprob_tokens(body),
                    update.logprobs_delta,
                    body.top_logprobs or 0,
                    before_delta(update.logprobs, update.logprobs_delta),
                )
                if logprobs_shown and j == 0
                else None
            )
            choice = {"index": update.index, "delta": delta, "logprobs": logprobs, "finish_reason": None}
            if body.return_token_ids:  # null where left out, as in the whole answer
                choice["token_ids"] = (update.token_ids_delta if j == 0 else []) if ids_shown else None
            yield chunk(choice, update)
        if update.finished:
            final[update.index] = update
            yield chunk(
                {
                    "index": update.index,
                    "delta": {},
                    "logprobs": None,
                    "finish_reason": plan.finish_reason(streamer.called, update.finish_reason),
                    "stop_reason": update.stop_reason,
                },
                update,
            )
    if usage_of is not None:
        yield sse({**base, "choices": [], "usage": usage([[final[k] for k in sorted(final)]], state.reasoning_counter)})
    yield DONE
