"""The grammar side of the tool-call formats: what constrains a model's calls to a request's tools.

- `calls_schema`: the generic format's whole output, `{"tool_calls": [{"name": ..., "arguments": {...}}]}`, as one
  JSON schema: what tool_choice "required" and a named function force.
- `calls_format`: an xgrammar structural tag format (vLLM's way since 0.32) in the model's own call format: the
  calls "required" and a named function force, or, under "auto", text in which a call the model opens must go on to
  name an allowed tool with arguments that hold to the schema given for it: hermes' `<tool_call>` anywhere in the
  text; llama3_json's `{"name": ` and generic's `{"tool_calls"` where the output opens (their parsers read calls
  nowhere else), the free text opening no object. Built for these three; none for the others (mistral's marker is a
  special token, pythonic calls are Python), where calls stay unconstrained, as in vLLM.

Each tool comes as (name, arguments schema); the caller decides the schema (a strict tool's parameters, or any
object).
"""

from __future__ import annotations

import json
from typing import Any

from pagoda.sampling_params import StructuredOutputsParams
from pagoda.tools.parsers import HELD_PARSERS, HERMES_LAYOUT, HERMES_START, LLAMA3_LAYOUT, HeldLayout

ANY_ARGUMENTS: dict[str, Any] = {"type": "object"}
# A tool without parameters (or with `{}`) takes none, as OpenAI documents it and vLLM holds it
NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}}
TOOL_STRICT_LEVELS = ("auto", "function", "parameter")  # vLLM's --tool-strict-level (tool_calls.ToolSettings)

Call = tuple[str, dict[str, Any]]  # a tool's name and the schema its arguments must hold to


def calls_schema(tools: list[Call], parallel: bool) -> dict[str, Any]:
    """The generic format's JSON schema, for calls of `tools` only (one call unless `parallel`)."""
    array = calls_array_schema(tools, parallel)
    definitions = array.pop("$defs", None)
    schema = {"type": "object", "properties": {"tool_calls": array}, "required": ["tool_calls"]}
    return {**schema, "$defs": definitions} if definitions else schema


def calls_array_schema(tools: list[Call], parallel: bool) -> dict[str, Any]:
    """The generic format's list of calls, at least one (one at most unless `parallel`). Each tool's own
    definitions move to the root, renamed per tool, so its local $refs still hold."""
    calls, definitions = [], {}
    for i, (name, parameters) in enumerate(tools):
        arguments, own = _lift_definitions(f"t{i}_", parameters)
        definitions.update(own)
        calls.append(
            {
                "type": "object",
                "properties": {"name": {"const": name}, "arguments": arguments},
                "required": ["name", "arguments"],
            }
        )
    items = calls[0] if len(calls) == 1 else {"anyOf": calls}
    array = {"type": "array", "items": items, "minItems": 1, **({} if parallel else {"maxItems": 1})}
    return {**array, "$defs": definitions} if definitions else array


HELD_FORMATS = tuple(HELD_PARSERS)  # the formats whose calls open with a fixed text
# What a whole-output format (llama3_json, generic) may write instead of its calls, after JSON whitespace
# (parsers.JSON_SPACE, which its parser skips): text that opens no JSON object, nor llama3_json's
# <|python_tag|> (the parser reads calls after it), so that every call its parser reads is one the grammar held
_WHITESPACE = {"type": "regex", "pattern": r"[ \t\n\r]*"}
_NOT_AN_OBJECT = {"type": "regex", "pattern": r"[ \t\n\r]*([^ \t\n\r{<][\s\S]*|<[^|][\s\S]*|<)?"}


def calls_format(parser: str, tools: list[Call], parallel: bool, required: bool) -> dict[str, Any] | None:
    """A structural tag format (the value of `{"type": "structural_tag", "format": ...}`) for `parser`'s calls of
    `tools`, each naming one of them with arguments valid against its schema, one call at most unless `parallel`:
    `required`, the output is the calls (hermes, llama3_json: calls only; generic: the calls object); else a text
    in which a call, once the model opens it, is held so (hermes: text around `<tool_call>`s; the whole-output
    formats: the calls, or text that does not open an object). None where the format has no fixed opening."""
    if parser == "generic":  # one object holds every call
        array = calls_array_schema(tools, parallel)
        calls = {"type": "tag", "begin": '{"tool_calls": ', "content": _json(array), "end": "}"}
    elif parser == "llama3_json":
        calls = _calls_only(_layout_tags(LLAMA3_LAYOUT, tools), LLAMA3_LAYOUT.separator, parallel)
    elif parser == "hermes":
        tags = _layout_tags(HERMES_LAYOUT, tools)
        if not required:
            return {
                "type": "triggered_tags",
                "triggers": [HERMES_START],  # what every one of HERMES_LAYOUT's heads opens with
                "tags": tags,
                "stop_after_first": not parallel,
            }
        calls = _calls_only(tags, HERMES_LAYOUT.separator, parallel)
    else:
        return None
    if required:
        return calls
    return {"type": "or", "elements": [{"type": "sequence", "elements": [_WHITESPACE, calls]}, _NOT_AN_OBJECT]}


def calls_or_answer(parser: str, tools: list[Call], parallel: bool, answer: dict[str, Any]) -> dict[str, Any]:
    """Calls as `calls_format` requires them, or the answer in `answer` (a format, `answer_format`'s). A
    generic-format call object is itself a JSON object: beside an answer of any object, one written as the
    answer is read as calls too (and not held)."""
    calls = calls_format(parser, tools, parallel, required=True)
    return {"type": "or", "elements": [calls, answer]}


def answer_format(constraint: StructuredOutputsParams) -> dict[str, Any]:
    """A request's own constraint as a structural tag format (to stand beside held calls): the same text
    it allows."""
    if constraint.json is not None or constraint.json_object:
        return _json(constraint.json if constraint.json is not None else {"type": "object"})
    if constraint.regex is not None:
        return {"type": "regex", "pattern": constraint.regex}
    if constraint.choice is not None:
        return {"type": "or", "elements": [{"type": "const_string", "value": text} for text in constraint.choice]}
    if constraint.grammar is not None:
        return {"type": "grammar", "grammar": constraint.grammar}
    return json.loads(constraint.structural_tag)["format"]  # sampling_params: every structural tag has one


def _layout_tags(layout: HeldLayout, tools: list[Call]) -> list[dict[str, Any]]:
    """A tag for each tool and spelling of a call in `layout` (its heads and tails pair up), as the parser of the
    calls a grammar holds reads them (parsers.HELD_PARSERS)."""
    return [
        {"type": "tag", "begin": f"{head}{json.dumps(name)}{layout.key}", "content": _json(schema), "end": tail}
        for name, schema in tools
        for head, tail in zip(layout.heads, layout.tails, strict=True)
    ]


def _calls_only(tags: list[dict[str, Any]], separator: str, parallel: bool) -> dict[str, Any]:
    return {
        "type": "tags_with_separator",
        "tags": tags,
        "separator": separator,
        "at_least_one": True,
        "stop_after_first": not parallel,
    }


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": schema}  # written compactly (structured.worker.compact_json)


def _lift_definitions(prefix: str, schema: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """`schema` without its `$defs`/`definitions`, and those definitions named `prefix + name`,
    every local $ref rewritten to them (`#` itself, and a pointer into it such as
    `#/properties/a`, to the schema kept as `prefix + "root"`)."""
    own = {**(schema.get("definitions") or {}), **(schema.get("$defs") or {})}
    refers_to_itself = False

    def rewrite(node: Any) -> Any:
        nonlocal refers_to_itself
        if isinstance(node, list):
            return [rewrite(item) for item in node]
        if not isinstance(node, dict):
            return node
        out = {k: rewrite(v) for k, v in node.items()}
        ref = node.get("$ref")
        if ref == "#":
            out["$ref"], refers_to_itself = f"#/$defs/{prefix}root", True
        elif isinstance(ref, str) and ref.startswith(("#/$defs/", "#/definitions/")):
            out["$ref"] = f"#/$defs/{prefix}{ref.split('/', 2)[2]}"
        elif isinstance(ref, str) and ref.startswith("#/"):
            out["$ref"], refers_to_itself = f"#/$defs/{prefix}root/{ref[2:]}", True
        return out

    body = rewrite({k: v for k, v in schema.items() if k not in ("$defs", "definitions", "$schema")})
    lifted = {f"{prefix}{name}": rewrite(sub) for name, sub in own.items()}
    if refers_to_itself:
        lifted[f"{prefix}root"] = body
    return body, lifted


def parameters_of(function: dict[str, Any]) -> dict[str, Any]:
    """The schema a function tool's arguments hold to: its parameters, or none where it has none."""
    return function.get("parameters") or NO_ARGUMENTS
