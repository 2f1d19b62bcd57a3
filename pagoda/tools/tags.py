"""The grammar side of the tool-call formats: what constrains a model's calls to a request's tools.

- `calls_schema`: the generic format's whole output, `{"tool_calls": [{"name": ..., "arguments": {...}}]}`, as one
  JSON schema: what tool_choice "required" and a named function force.
- `calls_format`: under tool_choice "auto", an xgrammar structural tag format (vLLM's way since 0.32) that leaves the
  text free and binds each call from its opening marker on: the marker must go on to name an allowed tool, and the
  arguments must hold to the schema given for it. Built for the formats whose calls open with a fixed text (hermes'
  `<tool_call>`, llama3_json's `{"name": `, generic's `{"tool_calls"`), the text each parser reads; none for the
  others (mistral's marker is a special token, pythonic calls are Python), where calls stay unconstrained, as in vLLM.

Each tool comes as (name, arguments schema); the caller decides the schema (a strict tool's parameters, or any
object).
"""

from __future__ import annotations

import json
from typing import Any

from pagoda.structured.schema import discriminated_as_any_of

ANY_ARGUMENTS: dict[str, Any] = {"type": "object"}
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


# format -> (the text that opens a call, that call's text before its arguments, the text after them)
_TAGGED = {
    "hermes": ("<tool_call>", '<tool_call>\n{{"name": {name}, "arguments": ', "}\n</tool_call>"),
    "llama3_json": ('{"name": ', '{{"name": {name}, "parameters": ', "}"),
}
_GENERIC_OPENING = '{"tool_calls"'


def calls_format(parser: str, tools: list[Call], parallel: bool, required: bool) -> dict[str, Any] | None:
    """A structural tag format (the value of `{"type": "structural_tag", "format": ...}`) for `parser`'s calls of
    `tools`: free text in which every call, once its opening text is written, names one of them and has
    arguments valid against its schema; one call at most unless `parallel`. `required`: the output opens with a
    call. None where the format has no fixed opening text."""
    if parser == "generic":  # one object holds every call, and opens the output
        array = calls_array_schema([(name, discriminated_as_any_of(schema)) for name, schema in tools], parallel)
        tag = {"type": "tag", "begin": _GENERIC_OPENING + ": ", "content": _json(array), "end": "}"}
        return _triggered([_GENERIC_OPENING], [tag], stop_after_first=True, required=required)
    if parser not in _TAGGED:
        return None
    opening, begin, end = _TAGGED[parser]
    tags = [
        {"type": "tag", "begin": begin.format(name=json.dumps(name)), "content": _json(schema), "end": end}
        for name, schema in tools
    ]
    return _triggered([opening], tags, stop_after_first=not parallel, required=required)


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": discriminated_as_any_of(schema)}


def _triggered(triggers: list[str], tags: list[dict], stop_after_first: bool, required: bool) -> dict[str, Any]:
    return {
        "type": "triggered_tags",
        "triggers": triggers,
        "tags": tags,
        "at_least_one": required,
        "stop_after_first": stop_after_first,
    }


def _lift_definitions(prefix: str, schema: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """`schema` without its `$defs`/`definitions`, and those definitions named `prefix + name`,
    every local $ref rewritten to them (`#` itself to the schema, kept as `prefix + "root"`)."""
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
        return out

    body = rewrite({k: v for k, v in schema.items() if k not in ("$defs", "definitions", "$schema")})
    lifted = {f"{prefix}{name}": rewrite(sub) for name, sub in own.items()}
    if refers_to_itself:
        lifted[f"{prefix}root"] = body
    return body, lifted
