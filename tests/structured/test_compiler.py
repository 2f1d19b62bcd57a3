"""The grammar compiler: its disk cache survives a restart, and a compile past its time limit is
abandoned (its worker killed) without breaking the compiles after it."""

from __future__ import annotations

import json
import logging
import re

import pytest

from pagoda.model_files import load_tokenizer
from pagoda.sampling_params import StructuredOutputsParams
from pagoda.structured.compiler import GrammarCompiler, GrammarError, check_json_schema, check_supported
from pagoda.structured.schema import discriminated_as_any_of

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return load_tokenizer(default_model_dir)


def compiler(tokenizer, tmp_path, timeout_s: float = 60.0) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id], timeout_s, tmp_path)


def test_compiled_grammars_are_cached_on_disk_across_restarts(tokenizer, tmp_path) -> None:
    first = compiler(tokenizer, tmp_path)
    try:
        first.compile(StructuredOutputsParams(json=SCHEMA))
        assert first._process is not None  # compiled by the worker
        assert len(list((tmp_path / "grammars").rglob("*.json"))) == 1
    finally:
        first.close()
    second = compiler(tokenizer, tmp_path)
    # The same schema sent as JSON text with other spacing: the same constraint, read from disk.
    assert second.compile(StructuredOutputsParams(json=json.dumps(SCHEMA, indent=4))) is not None
    assert second._process is None  # no worker was needed
    assert second.cached(StructuredOutputsParams(json=SCHEMA)) is not None
    second.close()


def test_property_order_is_part_of_the_constraint() -> None:
    """xgrammar writes properties in the schema's order: reordered schemas are other grammars."""
    a = {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}}
    b = {"type": "object", "properties": {"y": {"type": "integer"}, "x": {"type": "integer"}}}
    assert StructuredOutputsParams(json=a).key != StructuredOutputsParams(json=b).key
    assert StructuredOutputsParams(json=a).key == StructuredOutputsParams(json=json.dumps(a)).key


def test_a_compile_past_its_time_limit_is_abandoned_and_the_next_one_works(tokenizer, tmp_path) -> None:
    grammars = compiler(tokenizer, tmp_path, timeout_s=0.001)
    try:
        with pytest.raises(GrammarError, match="took longer than 0.001 s"):
            grammars.compile(StructuredOutputsParams(regex="[a-z]{1,40}@[a-z]{1,40}"))
        assert grammars._process is None  # the worker was killed
        grammars.timeout_s = 60.0
        assert grammars.compile(StructuredOutputsParams(choice=["left", "right"])) is not None
        assert grammars._process is not None and grammars._process.poll() is None
    finally:
        grammars.close()


@pytest.mark.parametrize(
    "schema, where",
    [
        ({"type": "strnig"}, "type"),
        ({"type": "object", "properties": {"a": {"minLength": -1}}}, "properties/a/minLength"),
        ({"type": "array", "items": 3}, "items"),
    ],
)
def test_invalid_json_schemas_are_refused_with_the_place(schema, where) -> None:
    with pytest.raises(GrammarError, match=f"invalid JSON schema at {where}"):
        check_json_schema(schema)


@pytest.mark.parametrize(
    "schema, message",
    [
        ({"type": "array", "uniqueItems": True}, "uses `uniqueItems`, which"),
        ({"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 3}}}, "`multipleOf` at properties/n"),
        ({"anyOf": [{"type": "string"}, {"not": {"type": "null"}}]}, "`not` at anyOf/1"),
        ({"$defs": {"a": {"if": {}, "then": {}}}, "$ref": "#/$defs/a"}, "`if` at $defs/a"),
        ({"type": "array", "items": {"contains": {"type": "integer"}}}, "`contains` at items"),
        ({"$ref": "https://example.com/s.json"}, "another document"),
        ({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["b"]}, "requires 'b' without"),
        ({"properties": {"x": {"type": "object", "required": ["a", "b"]}}}, "'a', 'b' at properties/x"),
    ],
)
def test_keywords_xgrammar_would_ignore_are_refused(schema, message) -> None:
    with pytest.raises(GrammarError, match=re.escape(message)):
        check_supported(schema)


def test_not_strict_what_xgrammar_would_ignore_is_listed_but_references_still_refused() -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 3}}, "required": ["m"]}
    left = check_supported(schema, strict=False)
    assert len(left) == 2 and "requires 'm'" in left[0] and "`multipleOf` at properties/n" in left[1]
    for dangling in ({"$ref": "https://example.com/s.json"}, {"properties": {"p": {"$ref": "#/$defs/Missing"}}}):
        with pytest.raises(GrammarError):
            check_supported(dangling, strict=False)


def test_a_property_named_like_a_keyword_is_fine() -> None:
    check_supported({"type": "object", "properties": {"not": {"type": "string"}, "if": {"type": "integer"}}})


def test_required_properties_defined_beside_them_are_fine() -> None:
    check_supported({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]})


@pytest.mark.parametrize(
    "schema",
    [  # xgrammar lets `{}` through each of these
        {"allOf": [{"properties": {"a": {"type": "string"}}}], "required": ["a"]},
        {"$defs": {"B": {"type": "object", "properties": {"y": {}}}}, "$ref": "#/$defs/B", "required": ["y"]},
        {"anyOf": [{"type": "object", "properties": {"a": {"type": "string"}}}], "required": ["a"]},
    ],
)
def test_required_properties_defined_only_by_a_composition_are_refused(schema) -> None:
    with pytest.raises(GrammarError, match="without defining it in `properties`"):
        check_supported(schema)


def test_a_schema_nested_too_deeply_is_refused_by_name() -> None:
    schema: dict = {"type": "string"}
    for _ in range(2000):
        schema = {"type": "array", "items": schema}
    with pytest.raises(GrammarError, match="nested too deeply"):
        check_json_schema(schema)


@pytest.mark.parametrize(
    "schema, warning",
    [
        ({"allOf": [{"type": "integer"}, {"minimum": 3}]}, "allOf with multiple options"),
        ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "falling back to anyOf"),  # 2 is both
        ({"type": "string", "format": "date", "maxLength": 5}, "ignoring minLength/maxLength"),
        ({"type": "string", "pattern": "[a-z]+", "minLength": 3}, "ignoring minLength/maxLength"),
        ({"type": "string", "pattern": "(?=a)b"}, "Lookahead assertion is not supported"),
    ],
)
def test_what_xgrammar_would_enforce_less_of_is_refused_where_strict(tokenizer, tmp_path, schema, warning, caplog):
    """xgrammar warns (on its C++ stderr) and compiles a weaker grammar for these: where strict,
    refused instead, with its reason, and nothing is cached; schemas it enforces whole still
    compile in the same worker. Not strict, the weaker grammar serves (as vLLM's), logged."""
    grammars = compiler(tokenizer, tmp_path)
    try:
        with pytest.raises(GrammarError, match=f"cannot enforce this json constraint as given: .*{re.escape(warning)}"):
            grammars.compile(StructuredOutputsParams(json=schema, strict=True))
        assert not list(tmp_path.rglob("*.json"))
        with caplog.at_level(logging.INFO, logger="pagoda.structured.compiler"):
            assert grammars.compile(StructuredOutputsParams(json=schema)) is not None
        assert "not strict, leaving unenforced: " in caplog.text and warning in caplog.text
        for whole in (
            {"allOf": [{"type": "integer"}]},
            {"oneOf": [{"type": "integer"}, {"type": "string"}]},
            {"type": "string", "maxLength": 5},
        ):
            assert grammars.compile(StructuredOutputsParams(json=whole)) is not None
    finally:
        grammars.close()


def test_regexes_written_by_re_escape_compile_and_mean_what_python_means(tokenizer, tmp_path) -> None:
    """xgrammar warns that an escaped space, '#' or newline matches itself, which is what Python's re
    means by it: such regexes compile (vLLM serves them too) and match the text escaped; an unknown
    escaped letter, which Python refuses, is refused where strict."""
    import xgrammar

    grammars = compiler(tokenizer, tmp_path)
    try:
        text = "a b#c\nd"
        compiled = grammars.compile(StructuredOutputsParams(regex=re.escape(text)))
        for candidate, whole in [(text, True), ("a b#c", False)]:
            matcher = xgrammar.GrammarMatcher(compiled)
            assert matcher.accept_string(candidate)
            assert matcher.accept_token(tokenizer.eos_token_id) == whole  # the end only after all of it
        with pytest.raises(GrammarError, match=r"Escape sequence '\\q' is not recognized"):
            grammars.compile(StructuredOutputsParams(regex=r"a\qb", strict=True))
        # a warning that quotes a pattern holding the harmless warning's words is still refused
        quoting = r"x(?=q)|Escape sequence '\ ' is not recognized. The character itself will be matched"
        with pytest.raises(GrammarError, match="Lookahead"):
            grammars.compile(StructuredOutputsParams(json={"type": "string", "pattern": quoting}, strict=True))
    finally:
        grammars.close()


PETS = {  # what pydantic writes for `pet: Cat | Dog = Field(discriminator="pet_type")`
    "$defs": {
        "Cat": {
            "type": "object",
            "properties": {"pet_type": {"const": "cat", "type": "string"}, "meows": {"type": "integer"}},
            "required": ["pet_type", "meows"],
        },
        "Dog": {
            "type": "object",
            "properties": {"pet_type": {"enum": ["dog"], "type": "string"}, "barks": {"type": "number"}},
            "required": ["pet_type", "barks"],
        },
    },
    "type": "object",
    "properties": {
        "pet": {
            "oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}],
            "discriminator": {"propertyName": "pet_type", "mapping": {"cat": "#/$defs/Cat", "dog": "#/$defs/Dog"}},
        }
    },
    "required": ["pet"],
}


def test_a_discriminated_union_compiles_as_the_anyof_it_equals(tokenizer, tmp_path) -> None:
    """Branches that pin one required property to distinct constants cannot both match: oneOf is
    anyOf there, which the library enforces whole (its oneOf it only approximates, with a warning)."""
    rewritten = discriminated_as_any_of(PETS)
    assert "anyOf" in rewritten["properties"]["pet"] and "oneOf" not in rewritten["properties"]["pet"]
    assert "oneOf" in PETS["properties"]["pet"]  # the caller's schema is left as it was
    shared = {"oneOf": [{"type": "object", "properties": {"k": {"const": 1}}, "required": ["k"]}] * 2}
    assert "oneOf" in discriminated_as_any_of(shared)  # the same constant twice: not disjoint
    unrequired = {"oneOf": [{"type": "object", "properties": {"k": {"const": i}}} for i in (1, 2)]}
    assert "oneOf" in discriminated_as_any_of(unrequired)  # {} matches both
    untyped = {"oneOf": [{"properties": {"k": {"const": i}}, "required": ["k"]} for i in (1, 2)]}
    assert "oneOf" in discriminated_as_any_of(untyped)  # a string matches both
    grammars = compiler(tokenizer, tmp_path)
    try:
        assert grammars.compile(StructuredOutputsParams(json=PETS)) is not None
    finally:
        grammars.close()
