"""Tools on the chat endpoint: checking `tools` and `tool_choice`, the constraint that enforces
"required" and a named function, and turning a sequence's text into OpenAI's assistant message
(content, tool_calls, reasoning), whole or as stream deltas that add up to the same message.

How each `tool_choice` is served (as vLLM does):
- "none": the tools are rendered (unless --exclude-tools-when-tool-choice-none), the output is
  plain content;
- "auto": the model writes calls in its own format, read back by the tool-call parser
  (`--tool-call-parser`, else detected from the chat template, else Pagoda's generic format for
  templates without tool support); needs `--enable-auto-tool-choice`. Where a tool is strict,
  allowed_tools names some, parallel_tool_calls is false or --tool-strict-level asks, a structural
  tag holds each call the model opens to the tools it may call and their schemas (tags.calls_format);
- "required" and a named function: a grammar forces calls of the allowed tools, in the model's own
  format where its calls open with a fixed text (hermes, llama3_json: a structural tag, as vLLM
  0.32), else in the generic format, `{"tool_calls": [{"name": ..., "arguments": {...}}]}`, so
  the calls always parse and their arguments validate against the tools' schemas (all of a strict
  tool's; of another's, as vLLM, all but what the grammar cannot enforce, such as `uniqueItems`).
"""

from __future__ import annotations

import dataclasses
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pagoda.entrypoints.openai.errors import bad_request
from pagoda.model_files import template_supports_tools
from pagoda.sampling_params import StructuredOutputsParams
from pagoda.structured.compiler import GrammarError, check_json_schema, check_supported
from pagoda.tools.parsers import HELD_PARSERS, Piece, ToolCall, ToolCallDelta, ToolParser, detect_parser, get_parser
from pagoda.tools.reasoning import REASONING_PARSERS
from pagoda.tools.tags import (
    ANY_ARGUMENTS,
    HELD_FORMATS,
    TOOL_STRICT_LEVELS,
    Call,
    calls_format,
    calls_or_answer,
    calls_schema,
    parameters_of,
)

FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # OpenAI's rule for function names


@dataclass(frozen=True)
class ToolSettings:
    """The server's tool flags."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None  # None: detected from the chat template, else generic
    reasoning_parser: str | None = None
    exclude_tools_when_none: bool = False  # tool_choice "none" renders no tools (vLLM's flag of that name)
    # vLLM's --tool-strict-level, what "auto" constrains: "auto" the calls of strict tools (and of
    # allowed_tools, and one call where parallel_tool_calls is false); "function" every call's
    # envelope and name; "parameter" also every call's arguments, as if every tool were strict
    tool_strict_level: str = "auto"

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None:
            get_parser(self.tool_call_parser)  # an unknown name fails at startup
        if self.tool_strict_level not in TOOL_STRICT_LEVELS:
            raise ValueError(
                f"unknown tool strict level {self.tool_strict_level!r}; choose one of {TOOL_STRICT_LEVELS}"
            )
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(
                f"unknown reasoning parser {self.reasoning_parser!r}; choose one of {', '.join(REASONING_PARSERS)}"
            )


@dataclass(frozen=True)
class ToolPlan:
    """What one chat request does with tools and reasoning."""

    tools: list[dict[str, Any]] | None = None  # rendered for the model (None: no tools)
    parser: ToolParser | None = None  # reads calls out of the output (None: all content)
    constraint: StructuredOutputsParams | None = None  # forces the calls ("required", a named function)
    held: HeldCalls | None = None  # under "auto", the calls a grammar holds, where it does
    allowed: frozenset[str] | None = None  # allowed_tools' "auto": a call of another tool is content
    # (tool index, arguments schema, strict) of each tool whose arguments the constraint holds
    enforced: tuple[tuple[int, dict[str, Any], bool], ...] = ()
    reasoning: Any = None  # a ReasoningParser, or None
    max_calls: int | None = None  # parallel_tool_calls false under "auto": the first call only, as vLLM
    named: bool = False  # tool_choice names one function
    # vLLM's include_reasoning: false leaves the parsed reasoning out of the answer
    show_reasoning: bool = True

    def message(self, text: str) -> tuple[dict[str, Any], bool]:
        """The assistant message for a sequence's whole text, and whether it called tools with whole
        calls (see finish_reason; a forced call cut short keeps the sequence's own reason)."""
        reasoning, text = self.reasoning.parse(text) if self.reasoning is not None else (None, text)
        parsed = self.parser.parse(text, self.known) if self.parser is not None else None
        calls = parsed.tool_calls[: self.max_calls] if parsed is not None else []
        content = parsed.content if parsed is not None else text
        message: dict[str, Any] = {"role": "assistant", "content": content if content.strip() or not calls else None}
        if calls:
            message["tool_calls"] = [_call_object(call) for call in calls]
        if reasoning is not None and self.show_reasoning:
            message["reasoning"] = message["reasoning_content"] = reasoning
        return message, bool(calls) and parsed is not None and parsed.calls_whole

    def shows_per_token(self, asked: bool) -> bool:
        """Whether an answer carries the per-token data (logprobs, token ids) it `asked` for: not
        where a reasoning parser splits the output and include_reasoning is false, since they would
        show the reasoning left out (vLLM's rule)."""
        return asked and (self.reasoning is None or self.show_reasoning)

    def finish_reason(self, called: bool, reason: str | None) -> str | None:
        """A choice's finish_reason: "tool_calls" where it called tools with whole calls, but the
        sequence's own ("stop") for the call of a function tool_choice names, as OpenAI and vLLM."""
        return "tool_calls" if called and not self.named else reason

    def streamer(self) -> MessageStreamer:
        return MessageStreamer(self)

    def known(self, name: str) -> bool:
        """Whether a call's name is one of the tools it may call (a call of any other is content)."""
        if self.allowed is not None:
            return name in self.allowed
        return any(tool["function"]["name"] == name for tool in self.tools or ())


@dataclass(frozen=True)
class HeldCalls:
    """Calls under "auto" that a grammar holds (tags.calls_format): in `parser`'s format, of `calls`
    (each tool it may call and the schema its arguments hold to), one at most unless `parallel`.
    `beside_answer`: held beside the request's own constraint too (a call, or the answer), where a
    strict tool, allowed_tools or --tool-strict-level asks, not parallel_tool_calls false alone
    (vLLM's rule: that flag never makes calls possible that the constraint rules out)."""

    parser: str
    calls: tuple[Call, ...]
    parallel: bool
    beside_answer: bool

    def read_by(self) -> ToolParser:
        """The parser of the output where the grammar holds the calls: each is sent as it is generated."""
        return HELD_PARSERS[self.parser]

    def within_text(self) -> dict[str, Any]:
        return calls_format(self.parser, list(self.calls), self.parallel, required=False)

    def or_answer(self, answer: dict[str, Any]) -> dict[str, Any]:
        return calls_or_answer(self.parser, list(self.calls), self.parallel, answer)


@dataclass
class MessageStreamer:
    """One sequence's stream: text deltas in, OpenAI delta objects out."""

    plan: ToolPlan
    _sent_calls: bool = False
    _ids: dict[int, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._reasoning = self.plan.reasoning.streamer() if self.plan.reasoning is not None else None
        self._tools = self.plan.parser.streamer(self.plan.known) if self.plan.parser is not None else None

    def feed(self, text: str) -> list[dict[str, Any]]:
        reasoning, content = self._reasoning.feed(text) if self._reasoning is not None else ("", text)
        return self._deltas(reasoning, self._tools.feed(content) if self._tools is not None else [content])

    def finish(self) -> list[dict[str, Any]]:
        reasoning, content = self._reasoning.finish() if self._reasoning is not None else ("", "")
        pieces = self._tools.feed(content) + self._tools.finish() if self._tools is not None else [content]
        return self._deltas(reasoning, pieces)

    @property
    def called(self) -> bool:
        """After finish(): it sent calls, each whole (see ToolPlan.finish_reason)."""
        return self._sent_calls and (self._tools is None or self._tools.calls_whole())

    def _deltas(self, reasoning: str, pieces: list[Piece]) -> list[dict[str, Any]]:
        """OpenAI delta objects in the order of the text: reasoning, then content and calls as they came."""
        out: list[dict[str, Any]] = []
        if reasoning and self.plan.show_reasoning:
            out.append({"reasoning": reasoning, "reasoning_content": reasoning})
        for piece in pieces:
            if isinstance(piece, str):
                if piece:
                    out.append({"content": piece})
            elif self.plan.max_calls is None or piece.index < self.plan.max_calls:  # past it: dropped, as whole
                out.append({"tool_calls": [self._call_entry(piece)]})
        return out

    def _call_entry(self, call: ToolCallDelta) -> dict[str, Any]:
        self._sent_calls = True
        if call.name is None:
            return {"index": call.index, "function": {"arguments": call.arguments}}
        self._ids[call.index] = _call_id()
        return {
            "index": call.index,
            "id": self._ids[call.index],
            "type": "function",
            "function": {"name": call.name, "arguments": call.arguments},
        }


def plan_tools(
    tools: Any,
    tool_choice: Any,
    parallel_tool_calls: bool,
    settings: ToolSettings,
    template: str | None,
    include_reasoning: bool = True,
) -> ToolPlan:
    """Check a request's tools and tool_choice (400s name the field) and decide how to serve them."""
    reasoning = REASONING_PARSERS[settings.reasoning_parser] if settings.reasoning_parser else None
    checked = check_tools(tools)
    choice, forced = _check_choice(tool_choice, checked)
    if not checked or choice == "none":
        shown = None if settings.exclude_tools_when_none else checked or None
        return ToolPlan(tools=shown, reasoning=reasoning, show_reasoning=include_reasoning)
    # A template that cannot show tools got them in the system prompt, in the generic format.
    name = (settings.tool_call_parser or detect_parser(template)) if template_supports_tools(template) else None
    if choice == "auto":
        if not settings.enable_auto_tool_choice:
            raise bad_request(
                '"auto" tool choice requires the server to run with --enable-auto-tool-choice '
                '(tool_choice "required", a named function and "none" work without it)',
                "tool_choice",
            )
        plan = ToolPlan(
            tools=checked,
            parser=get_parser(name or "generic"),
            reasoning=reasoning,
            max_calls=None if parallel_tool_calls else 1,
            show_reasoning=include_reasoning,
        )
        return _constrained_auto(plan, name or "generic", checked, forced, parallel_tool_calls, settings)
    indices = _forced_indices(checked, choice, forced)
    _check_enforceable(checked, indices, is_strict)
    calls = _calls(checked, indices, held=set(indices))
    parallel = parallel_tool_calls and choice == "required"
    # strict only where every tool is: the library's warnings cannot be told apart by tool, so
    # the server compiles each strict one alone too (ServerState.check_constraint)
    strict = all(is_strict(checked[i]) for i in indices)
    # in the model's own format where its calls open with a fixed text (as vLLM 0.32), else the generic one
    native = calls_format(name, calls, parallel, required=True) if name in HELD_FORMATS and name != "generic" else None
    if native is not None:
        constraint = StructuredOutputsParams(structural_tag={"type": "structural_tag", "format": native}, strict=strict)
    else:
        constraint = StructuredOutputsParams(json=calls_schema(calls, parallel), strict=strict)
    return ToolPlan(
        tools=checked,
        parser=HELD_PARSERS[name if native is not None else "generic"],  # calls sent as they are generated
        constraint=constraint,
        reasoning=reasoning,
        named=choice == "function",
        show_reasoning=include_reasoning,
        enforced=tuple((i, schema, is_strict(checked[i])) for i, (_, schema) in zip(indices, calls)),
    )


def _constrained_auto(
    plan: ToolPlan,
    parser: str,
    tools: list[dict[str, Any]],
    allowed: frozenset[str] | None,
    parallel: bool,
    settings: ToolSettings,
) -> ToolPlan:
    """The plan of "auto" with its calls constrained where vLLM constrains them (tags.calls_format): a
    strict tool's arguments held to its schema, an allowed_tools' "auto" held to its tools, one call
    where parallel_tool_calls is false, or every call where --tool-strict-level asks; the text stays free.
    A format without a fixed opening (mistral, pythonic) stays unconstrained, as in vLLM."""
    level = settings.tool_strict_level
    plan = dataclasses.replace(plan, allowed=allowed)
    callable_ = [i for i, tool in enumerate(tools) if allowed is None or tool["function"]["name"] in allowed]
    # arguments held to the schema: a strict tool's, or every tool's at level "parameter" (refused
    # where the grammar cannot enforce all of it only for a strict one)
    held = [i for i in callable_ if level == "parameter" or is_strict(tools[i])]
    beside_answer = bool(held) or allowed is not None or level != "auto"
    if not (beside_answer or not parallel) or parser not in HELD_FORMATS:
        return plan
    _check_enforceable(tools, held, is_strict)
    calls = _calls(tools, callable_, held=set(held))
    enforced = tuple((i, schema, is_strict(tools[i])) for i, (_, schema) in zip(callable_, calls) if i in held)
    return dataclasses.replace(plan, held=HeldCalls(parser, tuple(calls), parallel, beside_answer), enforced=enforced)


def _calls(tools: list[dict[str, Any]], indices: list[int], held: set[int]) -> list[Call]:
    """(name, arguments schema) of the tools at `indices`: its parameters for those `held` to them, any object else."""
    return [
        (
            tools[i]["function"]["name"],
            parameters_of(tools[i]["function"]) if i in held else ANY_ARGUMENTS,
        )
        for i in indices
    ]


def _forced_indices(tools: list[dict[str, Any]], choice: str, forced: frozenset[str] | None) -> list[int]:
    """The tools a checked choice forces calls of: for "required" all (or its allowed ones), the
    named one for a function, none else."""
    if choice not in ("required", "function"):
        return []
    return [i for i, tool in enumerate(tools) if forced is None or tool["function"]["name"] in forced]


def check_tools(tools: Any) -> list[dict[str, Any]]:
    """A request's tools, each a function tool with a valid name and parameters schema (400s name
    the field); [] for none."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise bad_request("tools must be a list of function tools", "tools")
    names: set[str] = set()
    for i, tool in enumerate(tools):
        param = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise bad_request(f'{param} must be {{"type": "function", "function": {{...}}}}', param)
        function = tool["function"]
        name = function.get("name")
        if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
            raise bad_request(f"{param}.function.name must be 1-64 letters, digits, _ . or -", f"{param}.function.name")
        if name in names:
            raise bad_request(f"{param}.function.name {name!r} is given twice", f"{param}.function.name")
        names.add(name)
        parameters = function.get("parameters")
        if parameters is not None:
            if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
                raise bad_request(
                    f"{param}.function.parameters must be a JSON schema of an object", f"{param}.function.parameters"
                )
            try:
                check_json_schema(parameters)
            except GrammarError as exc:
                raise bad_request(f"{param}.function.parameters: {exc}", f"{param}.function.parameters") from None
    return tools


def is_strict(tool: dict[str, Any]) -> bool:
    """OpenAI's `function.strict`: the tool's arguments validate against all of its schema, or it is refused."""
    return tool["function"].get("strict") is True


def _check_enforceable(
    tools: list[dict[str, Any]], indices: list[int], strict: Callable[[dict[str, Any]], bool]
) -> None:
    """The parameters of the tools at `indices` (those a grammar holds calls to) refer to nothing the
    grammar cannot follow, and where a tool is `strict` (OpenAI's `function.strict`) hold nothing it
    would leave unenforced (a tool that is only shown to the model is served as vLLM serves it,
    however loosely its schema is written)."""
    for i in indices:
        try:
            check_supported(parameters_of(tools[i]["function"]), strict(tools[i]))
        except GrammarError as exc:
            param = f"tools[{i}].function.parameters"
            raise bad_request(f"{param}: {exc}", param) from None


def _check_choice(tool_choice: Any, tools: list[dict[str, Any]]) -> tuple[str, frozenset[str] | None]:
    """("none" | "auto" | "required", None: any tool), ("function", {the name it forces}), or for
    OpenAI's allowed_tools ("auto" | "required", the names it allows)."""
    if tool_choice is None:
        return ("auto" if tools else "none"), None
    if tool_choice in ("none", "auto", "required"):
        if tool_choice != "none" and not tools:
            raise bad_request(f'tool_choice "{tool_choice}" needs tools', "tool_choice")
        return tool_choice, None
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "allowed_tools":
        return _allowed_tools(tool_choice.get("allowed_tools"), tools)
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not (isinstance(tool_choice, dict) and tool_choice.get("type") == "function" and isinstance(name, str)):
        raise bad_request(
            'tool_choice must be "none", "auto", "required", {"type": "function", "function": {"name": ...}} or '
            '{"type": "allowed_tools", "allowed_tools": {"mode": ..., "tools": [...]}}',
            "tool_choice",
        )
    _check_named(name, tools, "tool_choice")
    return "function", frozenset([name])


def _allowed_tools(allowed: Any, tools: list[dict[str, Any]]) -> tuple[str, frozenset[str]]:
    """OpenAI's allowed_tools: `mode` "required" (calls of these only, forced) or "auto" (text, or
    calls of these only, where the format's calls can be held to them), `tools` naming
    functions among the request's tools."""
    param = "tool_choice.allowed_tools"
    listed = allowed.get("tools") if isinstance(allowed, dict) else None
    if not isinstance(allowed, dict) or allowed.get("mode") not in ("auto", "required") or not isinstance(listed, list):
        raise bad_request(f'{param} must be {{"mode": "auto" or "required", "tools": [...]}}', param)
    names = []
    for j, tool in enumerate(listed):
        function = tool.get("function") if isinstance(tool, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            raise bad_request(f'{param}.tools[{j}] must be {{"type": "function", "function": {{"name": ...}}}}', param)
        _check_named(name, tools, f"{param}.tools[{j}]")
        names.append(name)
    if not names:
        raise bad_request(f"{param}.tools must name at least one function", param)
    return allowed["mode"], frozenset(names)


def _check_named(name: str, tools: list[dict[str, Any]], param: str) -> None:
    if name not in {t["function"]["name"] for t in tools}:
        raise bad_request(f"{param} names {name!r}, which is not among the tools", param)


def _call_object(call: ToolCall) -> dict[str, Any]:
    return {"id": _call_id(), "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"
