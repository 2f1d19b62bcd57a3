"""How a chat request's tools are served (ToolPlan), and the assistant message read back from
scripted outputs: whole, and streamed in every split, the same."""

from __future__ import annotations

import json

import pytest

from pagoda.entrypoints.openai.chat import planned
from pagoda.entrypoints.openai.errors import APIError
from pagoda.entrypoints.openai.tool_calls import ToolSettings, plan_tools
from pagoda.sampling_params import SamplingParams
from pagoda.tools.parsers import HELD_PARSERS, PARSERS
from pagoda.tools.tags import calls_schema

TOOL = {
    "type": "function",
    "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}},
}
AUTO = ToolSettings(enable_auto_tool_choice=True)


def plan(choice="auto", settings=AUTO, template=None, parallel=True, include_reasoning=True):
    return plan_tools([TOOL], choice, parallel, settings, template, include_reasoning)


def test_auto_takes_the_templates_format_else_generic():
    assert plan(template="{{ tools }}<tool_call>").parser is PARSERS["hermes"]
    assert plan(template="plain").parser is PARSERS["generic"]
    configured = ToolSettings(enable_auto_tool_choice=True, tool_call_parser="mistral")
    assert plan(settings=configured, template="{{ tools }}").parser is PARSERS["mistral"]
    assert plan().constraint is None


def test_required_and_named_are_constrained_to_the_generic_format():
    required = plan("required")
    assert required.parser is HELD_PARSERS["generic"]  # the generic format, streamed as the grammar writes it
    assert required.constraint.json == calls_schema([("f", TOOL["function"]["parameters"])], parallel=True)
    named = plan({"type": "function", "function": {"name": "f"}})
    assert named.constraint.json["properties"]["tool_calls"]["maxItems"] == 1
    assert plan("required", parallel=False).constraint.json["properties"]["tool_calls"]["maxItems"] == 1


STRICT = {"type": "function", "function": {**TOOL["function"], "name": "s", "strict": True}}


def tag_format(params: SamplingParams) -> dict:
    return json.loads(params.structured_outputs.structural_tag)["format"]


def test_auto_holds_calls_where_vllm_does():
    """Plain "auto" with tools that are not strict compiles nothing; a strict tool, allowed_tools,
    parallel_tool_calls false or --tool-strict-level hold the calls the model opens (a structural
    tag in the parser's format): to the tools it may call, their arguments to a strict tool's schema
    (at level "parameter" to every tool's, refused only where a strict one cannot be enforced)."""
    params = SamplingParams(max_tokens=8)
    assert plan().held is None and planned(params, plan(), None)[0].structured_outputs is None
    assert planned(params, plan(), None)[1].parser is PARSERS["generic"]  # calls sent whole, once known to be calls

    def held(tools, choice="auto", level="auto", parallel=True, template="plain"):
        settings = ToolSettings(enable_auto_tool_choice=True, tool_strict_level=level)
        return plan_tools(tools, choice, parallel, settings, template, True)

    any_object = {"type": "object"}
    assert dict(held([TOOL, STRICT]).held.calls) == {"f": any_object, "s": STRICT["function"]["parameters"]}
    assert dict(held([TOOL], parallel=False).held.calls) == {"f": any_object}
    assert dict(held([TOOL], level="function").held.calls) == {"f": any_object}
    assert dict(held([TOOL], level="parameter").held.calls) == {"f": TOOL["function"]["parameters"]}
    assert held([STRICT], template="{{ tools }}<tool_call>").held.parser == "hermes"
    assert held([STRICT], template="{{ tools }}[TOOL_CALLS]").held is None  # a special-token marker: free
    unique = {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}
    loose = {"type": "function", "function": {"name": "u", "parameters": unique}}
    assert held([loose], level="parameter").enforced == ((0, unique, False),)  # not strict: not refused
    allowed = {
        "type": "allowed_tools",
        "allowed_tools": {"mode": "auto", "tools": [{"type": "function", "function": {"name": "s"}}]},
    }
    restricted = held([TOOL, STRICT], choice=allowed)
    assert dict(restricted.held.calls) == {"s": STRICT["function"]["parameters"]}
    assert restricted.known("s") and not restricted.known("f")
    params, read, _, _ = planned(params, held([STRICT]), None)
    assert tag_format(params)["elements"][1]["type"] == "regex"  # text that opens no object: the calls alone may
    assert read.parser is HELD_PARSERS["generic"]  # (test_tags.py); held calls are sent as they come
    with pytest.raises(ValueError, match="tool strict level"):
        ToolSettings(tool_strict_level="always")


def test_a_constraint_beside_held_calls():
    """The request's own constraint beside them: a call first, or the answer as it allows (each part
    compiled alone too, named by its field); where only parallel_tool_calls false holds them, it
    applies alone, the calls unconstrained (vLLM's rule)."""
    from pagoda.sampling_params import StructuredOutputsParams

    tool_plan = plan_tools([STRICT], "auto", True, AUTO, "plain", True)
    answer = StructuredOutputsParams(json={"type": "object"}, strict=True)
    params, read, parts, field = planned(SamplingParams(structured_outputs=answer), tool_plan, "response_format")
    # an answer may look like calls (a JSON object with more keys): the output is read whole, as any
    assert read.parser is PARSERS["generic"]
    first, second = tag_format(params)["elements"]
    assert first["begin"] == '{"tool_calls": ' and second["json_schema"] == {"type": "object"}
    assert [name for name, _ in parts] == ["tools[0].function.parameters", "response_format"] and field == "tools"
    regex = StructuredOutputsParams(regex="[a-z]+")
    params, _, parts, field = planned(SamplingParams(structured_outputs=regex), tool_plan, "structured_outputs")
    assert tag_format(params)["elements"][1] == {"type": "regex", "pattern": "[a-z]+"} and field == "tools"
    one_call = plan_tools([TOOL], "auto", False, AUTO, "plain", True)
    params, read, parts, _ = planned(SamplingParams(structured_outputs=answer), one_call, "response_format")
    assert params.structured_outputs is answer and parts == []
    assert read.parser is PARSERS["generic"]  # not held: read as any output, calls sent once known


def test_forced_calls_take_the_models_own_format_where_it_opens_calls_with_a_fixed_text():
    """hermes and llama3_json: a structural tag in that format (vLLM 0.32's way); mistral (a
    special-token marker), pythonic and the generic format: the generic JSON. Either way read by the
    parser of held calls, which sends them as they come."""
    for template, parser in (("{{ tools }}<tool_call>", "hermes"), ("{{ tools }}<|python_tag|>", "llama3_json")):
        for choice in ("required", {"type": "function", "function": {"name": "f"}}):
            forced = plan(choice, template=template)
            assert forced.parser is HELD_PARSERS[parser] and forced.constraint.kind == "structural_tag"
            assert json.loads(forced.constraint.structural_tag)["format"]["at_least_one"]
    for template in ("{{ tools }}[TOOL_CALLS]", "plain"):
        assert plan("required", template=template).parser is HELD_PARSERS["generic"]


def test_a_parser_whose_markers_may_be_special_tokens_keeps_them_in_the_text():
    """As vLLM's hermes and mistral parsers ask: their markers are special tokens in some vocabularies
    (Mistral's [TOOL_CALLS]), which the default skip_special_tokens would drop before the parser reads
    them. The other formats, and requests the parser reads nothing of, keep the request's choice."""
    params = SamplingParams(max_tokens=8)
    cases = (("hermes", True), ("mistral", True), ("granite", True), ("llama3_json", False), ("pythonic", False))
    for parser, keeps in cases:
        settings = ToolSettings(enable_auto_tool_choice=True, tool_call_parser=parser)
        assert (
            planned(params, plan(settings=settings, template="{{ tools }}"), None)[0].skip_special_tokens is not keeps
        )
    assert planned(params, plan(template="plain"), None)[0].skip_special_tokens  # generic
    assert planned(params, plan("none", template="{{ tools }}<tool_call>"), None)[0].skip_special_tokens
    assert planned(params, plan("required"), None)[0].skip_special_tokens  # the grammar writes the generic format


def test_none_renders_the_tools_and_parses_nothing():
    none = plan("none")
    assert none.tools == [TOOL] and none.parser is None and none.constraint is None
    assert plan("none", settings=ToolSettings(exclude_tools_when_none=True)).tools is None
    assert none.message('{"tool_calls": [{"name": "f", "arguments": {}}]}')[1] is False


def test_auto_without_the_flag_names_it():
    with pytest.raises(APIError) as refused:
        plan(settings=ToolSettings())
    assert refused.value.param == "tool_choice" and "--enable-auto-tool-choice" in str(refused.value.message)


SCRIPTED = [
    ("hermes", 'Let me look.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'),
    ("generic", '{"tool_calls": [{"name": "f", "arguments": {"x": 2}}, {"name": "f", "arguments": {"x": 3}}]}'),
    ("generic", "Just text, no call."),
    ("pythonic", "\n[f(x=4), f(x=5)]\n"),
    ("hermes", "<tool_call>\n{not json}\n</tool_call>"),
    ("hermes", '<tool_call>\n{"name": "f_args", "arguments": {}}\n</tool_call>'),  # no such tool
    ("generic", '{"tool_calls": [{"name": "f", "arguments": {}}, {"name": "g", "arguments": {}}]}'),
]


@pytest.mark.parametrize("parser, text", SCRIPTED[-2:])
def test_a_call_of_no_listed_tool_stays_content(parser, text):
    """No client can run it (an agent SDK fails on it): it is read as a malformed call is."""
    settings = ToolSettings(enable_auto_tool_choice=True, tool_call_parser=parser)
    message, called = plan(settings=settings, template="{{ tools }}").message(text)
    assert message["content"] == text and "tool_calls" not in message and not called


@pytest.mark.parametrize("parser, text", SCRIPTED)
@pytest.mark.parametrize("reasoning", [None, "qwen3"])
def test_streamed_message_equals_the_whole_one(parser, text, reasoning):
    settings = ToolSettings(enable_auto_tool_choice=True, tool_call_parser=parser, reasoning_parser=reasoning)
    tool_plan = plan(settings=settings, template="{{ tools }}")
    if reasoning:
        text = f"<think>\nweighing it\n</think>\n\n{text}"
    whole, called = tool_plan.message(text)
    for size in (1, 3, 7, len(text)):
        streamer = tool_plan.streamer()
        deltas = [d for i in range(0, len(text), size) for d in streamer.feed(text[i : i + size])]
        deltas += streamer.finish()
        content = "".join(d.get("content", "") for d in deltas)
        assert content == (whole["content"] or "")
        assert "".join(d.get("reasoning", "") for d in deltas) == (whole.get("reasoning") or "")
        calls = [c for d in deltas for c in d.get("tool_calls", [])]
        names = [c["function"]["name"] for c in calls if "id" in c]
        arguments = {}
        for c in calls:
            arguments[c["index"]] = arguments.get(c["index"], "") + c["function"]["arguments"]
        assert names == [c["function"]["name"] for c in whole.get("tool_calls", [])]
        assert [arguments[i] for i in sorted(arguments)] == [
            c["function"]["arguments"] for c in whole.get("tool_calls", [])
        ]
        assert streamer.called is called
    if reasoning:
        assert whole["reasoning"] == whole["reasoning_content"] == "weighing it"
    if called:
        assert whole["content"] in (None, "Let me look.\n") and all(
            json.loads(c["function"]["arguments"]) for c in whole["tool_calls"]
        )


NESTED = {  # what pydantic writes for a model with a nested model: local $refs into $defs
    "$defs": {"Point": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}},
    "type": "object",
    "properties": {"at": {"$ref": "#/$defs/Point"}, "label": {"type": ["string", "null"]}},
    "required": ["at"],
}


def test_forced_calls_keep_each_tools_definitions(default_model_dir):
    import jsonschema
    import xgrammar

    from pagoda.model_files import load_tokenizer

    schema = calls_schema([("f", TOOL["function"]["parameters"]), ("g", NESTED)], parallel=True)
    call = {"tool_calls": [{"name": "g", "arguments": {"at": {"x": 1}, "label": None}}]}
    jsonschema.validate(call, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"tool_calls": [{"name": "g", "arguments": {"at": {"x": "one"}}}]}, schema)
    tokenizer = load_tokenizer(default_model_dir)
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    xgrammar.GrammarCompiler(info).compile_json_schema(json.dumps(schema))  # the refs resolve
    # a pointer into the tool's own schema points into it still, once the schema is one of several
    pointing = {
        "type": "object",
        "properties": {"a": {"type": "integer", "minimum": 3}, "b": {"$ref": "#/properties/a"}},
    }
    schema = calls_schema([("f", TOOL["function"]["parameters"]), ("g", pointing)], parallel=True)
    jsonschema.validate({"tool_calls": [{"name": "g", "arguments": {"a": 3, "b": 4}}]}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"tool_calls": [{"name": "g", "arguments": {"a": 3, "b": 1}}]}, schema)
    xgrammar.GrammarCompiler(info).compile_json_schema(json.dumps(schema))


@pytest.mark.parametrize(
    "parameters",
    [{"$schema": []}, {"$schema": 5}, {"type": "string"}, {"type": "object", "$defs": 5, "properties": {}}],
)
def test_odd_parameters_are_a_400_not_a_crash(parameters):
    tool = {"type": "function", "function": {"name": "f", "parameters": parameters}}
    with pytest.raises(APIError) as refused:
        plan_tools([tool], "required", True, AUTO, None)
    assert refused.value.status == 400 and refused.value.param == "tools[0].function.parameters"


def test_list_types_and_deep_nesting_never_raise():
    from pagoda.tools.prompt import with_tools_in_system_prompt

    tool = {"type": "function", "function": {"name": "g", "parameters": NESTED}}
    (system, _) = with_tools_in_system_prompt([{"role": "user", "content": "hi"}], [tool])
    assert '"label": "..."' in system["content"]
    deep = "<tool_call>" + "[" * 5000 + "]" * 5000 + "</tool_call>"
    assert PARSERS["hermes"].parse(deep).tool_calls == []


@pytest.mark.parametrize(
    "reasoning, text",
    [
        ("qwen3", "<think>\nweighing it\n</think>\n\nThe answer."),
        ("deepseek_r1", "weighing it\n</think>\n\nThe answer."),
    ],
)
@pytest.mark.parametrize("choice", ["none", {"type": "function", "function": {"name": "f"}}])
def test_include_reasoning_false_leaves_the_reasoning_out(reasoning, text, choice):
    """vLLM's include_reasoning false: the parsed reasoning is in neither the whole message nor the
    stream, the answer after it is the same, calls too, and no per-token data is shown."""
    settings = ToolSettings(enable_auto_tool_choice=True, reasoning_parser=reasoning)
    if choice != "none":
        text = text.replace("The answer.", '{"tool_calls": [{"name": "f", "arguments": {"x": 1}}]}')
    shown, hidden = plan(choice, settings=settings), plan(choice, settings=settings, include_reasoning=False)
    whole, called = shown.message(text)
    assert whole["reasoning"] == "weighing it" and shown.shows_per_token(True)
    message, hidden_called = hidden.message(text)
    assert "reasoning" not in message and "reasoning_content" not in message and hidden_called is called
    assert message["content"] == whole["content"]
    assert [c["function"] for c in message.get("tool_calls", [])] == [
        c["function"] for c in whole.get("tool_calls", [])
    ]
    assert (called and len(whole["tool_calls"]) == 1) == (choice != "none")
    streamer = hidden.streamer()
    deltas = [d for i in range(0, len(text), 3) for d in streamer.feed(text[i : i + 3])] + streamer.finish()
    assert all("reasoning" not in d for d in deltas) and streamer.called is called
    assert "".join(d.get("content", "") for d in deltas) == (whole["content"] or "")
    assert not hidden.shows_per_token(True) and not hidden.shows_per_token(False)
    assert plan("none", include_reasoning=False).shows_per_token(True)  # no parser: nothing is left out
