"""The grammars that hold a model's calls to a request's tools under tool_choice "auto" (tags.calls_format),
compiled as the server compiles them and run over texts token by token: free text passes, and a call, once its
opening is written, must name an allowed tool and give arguments valid against the schema it was given; each
format's calls read back by its own parser."""

from __future__ import annotations

import json

import pytest

from pagoda.model_files import load_tokenizer
from pagoda.sampling_params import StructuredOutputsParams
from pagoda.tools.parsers import PARSERS
from pagoda.tools.tags import ANY_ARGUMENTS, answer_format, calls_format, calls_or_answer

KELVIN = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["kelvin"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [("get_weather", KELVIN), ("get_time", ANY_ARGUMENTS)]
TAGGED = {
    "type": "tag",
    "begin": "<a>",
    "content": {"type": "json_schema", "json_schema": {"type": "object"}},
    "end": "</a>",
}

# a format's text of one call, as its parser reads it (and as the grammar writes it)
CALL = {
    "hermes": '<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>',
    "llama3_json": '{{"name": "{name}", "parameters": {arguments}}}',
    "generic": '{{"tool_calls": [{{"name": "{name}", "arguments": {arguments}}}]}}',
}


@pytest.fixture(scope="module")
def grammars(default_model_dir, tmp_path_factory):
    import xgrammar

    from pagoda.structured.compiler import GrammarCompiler

    tokenizer = load_tokenizer(default_model_dir)
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id], 60.0, None)

    def matches(format_: dict, text: str) -> bool:
        """Whether the grammar of a structural tag's format (or of a whole tag in the older form, with
        "structures") takes every token of `text` and may then end."""
        whole = format_ if "structures" in format_ else {"type": "structural_tag", "format": format_}
        tag = StructuredOutputsParams(structural_tag=whole)
        matcher = xgrammar.GrammarMatcher(compiler.compile(tag))
        ids = tokenizer.encode(text, add_special_tokens=False)
        return all(matcher.accept_token(t) for t in ids) and matcher.accept_token(tokenizer.eos_token_id)

    yield matches
    compiler.close()


def call(parser: str, name: str, arguments: dict) -> str:
    return CALL[parser].format(name=name, arguments=json.dumps(arguments))


@pytest.mark.parametrize("parser", sorted(CALL))
def test_a_call_holds_to_its_tools_and_schemas(grammars, parser):
    free = calls_format(parser, TOOLS, parallel=True, required=False)
    valid = call(parser, "get_weather", {"city": "Oslo", "unit": "kelvin"})
    assert grammars(free, "It is sunny.")
    assert grammars(free, valid)
    assert grammars(free, call(parser, "get_time", {"zone": "CET", "any": [1]}))  # not held: any object
    assert not grammars(free, call(parser, "get_weather", {"city": "Oslo", "unit": "celsius"}))
    assert not grammars(free, call(parser, "get_weather", {"city": "Oslo"}))
    assert not grammars(free, call(parser, "send_mail", {}))  # not among the tools it may call
    padded = valid.replace('"city": ', '"city":\n\n\n   ')  # JSON as compact as the server's other constraints
    assert not grammars(free, padded)
    parsed = PARSERS[parser].parse(valid)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        ("get_weather", {"city": "Oslo", "unit": "kelvin"})
    ]
    required = calls_format(parser, TOOLS, parallel=True, required=True)
    assert grammars(required, valid) and not grammars(required, "It is sunny.")


@pytest.mark.parametrize("parser", ["llama3_json", "generic"])
def test_a_whole_output_format_reads_no_call_the_grammar_did_not_hold(grammars, parser):
    """Its parser reads calls from an output that opens with a JSON object, however spaced: the free text
    beside the held calls never opens one, so every call it reads is one the grammar held."""
    free = calls_format(parser, TOOLS, parallel=True, required=False)
    respaced = call(parser, "get_weather", {"city": 5}).replace(": ", ":", 1)
    assert PARSERS[parser].parse(respaced).tool_calls  # a call, were it written
    assert not grammars(free, respaced) and not grammars(free, "  " + respaced)
    assert not grammars(free, '{"answer": 1}')
    mid_text = "Here: " + call(parser, "get_weather", {"city": 5})
    assert grammars(free, mid_text) and not PARSERS[parser].parse(mid_text).tool_calls  # text: no call
    for space in ("\x1c", "\x85"):  # whitespace to str.isspace, not to JSON: text, read as text
        assert not PARSERS[parser].parse(space + respaced).tool_calls
    held = "\n\n" + call(parser, "get_weather", {"city": "Oslo", "unit": "kelvin"})  # as after a reasoning's end
    assert grammars(free, held) and PARSERS[parser].parse(held).tool_calls
    if parser == "llama3_json":  # its parser reads calls after <|python_tag|>, here spelled as text
        tagged = "<|python_tag|>" + respaced
        assert PARSERS[parser].parse(tagged).tool_calls and not grammars(free, tagged)
        assert grammars(free, "<b>bold</b>") and grammars(free, "<")


def test_hermes_takes_both_spellings_and_a_required_call_is_calls_only(grammars):
    tight = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    assert PARSERS["hermes"].parse(tight).tool_calls
    for required in (False, True):
        assert grammars(calls_format("hermes", TOOLS, parallel=True, required=required), tight)
    required = calls_format("hermes", TOOLS, parallel=True, required=True)
    assert grammars(required, tight + tight) and not grammars(required, tight + " and some text")


@pytest.mark.parametrize("parser", ["hermes", "llama3_json"])
def test_one_call_only_where_parallel_calls_are_off(grammars, parser):
    separator = "; " if parser == "llama3_json" else ""
    two = call(parser, "get_time", {}) + separator + call(parser, "get_time", {})
    assert [c.name for c in PARSERS[parser].parse(two).tool_calls] == ["get_time", "get_time"]
    for required in (False, True):
        assert grammars(calls_format(parser, TOOLS, parallel=True, required=required), two)
        assert not grammars(calls_format(parser, TOOLS, parallel=False, required=required), two)
        one = calls_format(parser, TOOLS, parallel=False, required=required)
        assert grammars(one, call(parser, "get_time", {}))


def test_the_generic_format_holds_every_call_in_its_list(grammars):
    two = {"tool_calls": [{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {}}]}
    assert not grammars(calls_format("generic", TOOLS, parallel=True, required=False), json.dumps(two))
    two["tool_calls"][1]["arguments"] = {"city": "Oslo", "unit": "kelvin"}
    assert grammars(calls_format("generic", TOOLS, parallel=True, required=False), json.dumps(two))
    assert not grammars(calls_format("generic", TOOLS, parallel=False, required=False), json.dumps(two))


def test_calls_or_the_answer(grammars):
    answer = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
    either = calls_or_answer("generic", TOOLS, True, answer_format(StructuredOutputsParams(json=answer)))
    assert grammars(either, '{"answer": "sunny"}')
    assert grammars(either, call("generic", "get_weather", {"city": "Oslo", "unit": "kelvin"}))
    assert not grammars(either, call("generic", "get_weather", {"city": "Oslo", "unit": "celsius"}))
    assert not grammars(either, "It is sunny.")
    for constraint, text in (
        (StructuredOutputsParams(regex="(Yes|No), [a-z ]{1,20}"), "No, not today"),
        (StructuredOutputsParams(choice=["left", "right"]), "right"),
        (StructuredOutputsParams(grammar='root ::= "city: " [a-z]+'), "city: oslo"),
        (StructuredOutputsParams(structural_tag={"type": "structural_tag", "format": TAGGED}), "<a>{}</a>"),
    ):
        either = calls_or_answer("hermes", TOOLS, True, answer_format(constraint))
        assert grammars(either, text) and grammars(either, call("hermes", "get_time", {}))
        assert not grammars(either, text + "!") and not grammars(either, "Free text.")
    legacy = StructuredOutputsParams(structural_tag={"structures": [], "triggers": ["<a>"]})
    assert answer_format(legacy)["type"] == "triggered_tags"  # the older form, in the newer one


def test_formats_without_a_fixed_opening_have_no_grammar():
    """mistral's [TOOL_CALLS] is a special token, pythonic calls are Python: their calls stay free, as in vLLM."""
    assert calls_format("mistral", TOOLS, parallel=True, required=False) is None
    assert calls_format("pythonic", TOOLS, parallel=True, required=False) is None


def test_structural_tags_as_vllm_takes_them(grammars):
    """A structural tag (xgrammar's format, or the older structures and triggers) is a constraint of its own;
    one that is not JSON, or not an object, is refused naming the field."""
    from pagoda.sampling_params import SamplingParamsError

    tagged = {"type": "tag", "begin": "<a>", "content": {"type": "json_schema", "json_schema": KELVIN}, "end": "</a>"}
    assert grammars(tagged, '<a>{"city": "Oslo", "unit": "kelvin"}</a>')
    assert not grammars(tagged, '<a>{"city": "Oslo"}</a>') and not grammars(tagged, "text")
    legacy = {"structures": [{"begin": "<a>", "schema": KELVIN, "end": "</a>"}], "triggers": ["<a>"]}
    assert grammars(legacy, 'It is <a>{"city": "Oslo", "unit": "kelvin"}</a> there.')
    assert not grammars(legacy, 'It is <a>{"city": "Oslo", "unit": "celsius"}</a>')
    text = json.dumps({"type": "structural_tag", "format": tagged})
    assert (
        StructuredOutputsParams(structural_tag=text).key == StructuredOutputsParams(structural_tag=json.loads(text)).key
    )
    assert StructuredOutputsParams(structural_tag=text).kind == "structural_tag"
    for bad in ("{", "[1]", '{"type": "structural_tag"}', '{"structures": [{"begin": "<a>"}], "triggers": []}'):
        with pytest.raises(SamplingParamsError, match="structural tag"):
            StructuredOutputsParams(structural_tag=bad)
    with_options = {"type": "json_schema", "json_schema": {"type": "object"}, "excludes": ["bad"]}
    assert grammars(with_options, '{"s": "good"}') and not grammars(with_options, '{"s": "so bad"}')  # the library's
    with pytest.raises(SamplingParamsError, match="exactly one of"):
        StructuredOutputsParams(structural_tag=text, regex="a")
