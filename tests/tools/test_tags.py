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
from pagoda.tools.tags import ANY_ARGUMENTS, calls_format

KELVIN = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["kelvin"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [("get_weather", KELVIN), ("get_time", ANY_ARGUMENTS)]

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
    parsed = PARSERS[parser].parse(valid)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        ("get_weather", {"city": "Oslo", "unit": "kelvin"})
    ]
    required = calls_format(parser, TOOLS, parallel=True, required=True)
    assert grammars(required, valid) and not grammars(required, "It is sunny.")


@pytest.mark.parametrize("parser", ["hermes", "llama3_json"])
def test_one_call_only_where_parallel_calls_are_off(grammars, parser):
    two = call(parser, "get_time", {}) + call(parser, "get_time", {})
    assert grammars(calls_format(parser, TOOLS, parallel=True, required=False), two)
    assert not grammars(calls_format(parser, TOOLS, parallel=False, required=False), two)
    assert grammars(calls_format(parser, TOOLS, parallel=False, required=False), call(parser, "get_time", {}))


def test_the_generic_format_holds_every_call_in_its_list(grammars):
    two = {"tool_calls": [{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {}}]}
    assert not grammars(calls_format("generic", TOOLS, parallel=True, required=False), json.dumps(two))
    two["tool_calls"][1]["arguments"] = {"city": "Oslo", "unit": "kelvin"}
    assert grammars(calls_format("generic", TOOLS, parallel=True, required=False), json.dumps(two))
    assert not grammars(calls_format("generic", TOOLS, parallel=False, required=False), json.dumps(two))


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
    for bad in ("{", "[1]"):
        with pytest.raises(SamplingParamsError, match="structural tag"):
            StructuredOutputsParams(structural_tag=bad)
    with pytest.raises(SamplingParamsError, match="exactly one of"):
        StructuredOutputsParams(structural_tag=text, regex="a")
