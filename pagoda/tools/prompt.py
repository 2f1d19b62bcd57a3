"""Tools described in the system prompt, for models whose chat template cannot take `tools`.

The "generic" format, which the generic parser of pagoda.tools.parsers reads back:
- the system message starts with the tools (name, description, parameters JSON schema) and the
  instruction: to call tools, answer with only `{"tool_calls": [{"name": ..., "arguments": {...}}]}`;
  otherwise answer normally. An existing system message follows that text; without one, the
  tools are a new first message.
- An earlier assistant turn that called tools becomes that same JSON object, then its text (if
  any) on the next line, so the model sees its own calls written as it is told to write them and
  as the generic parser reads them back (calls first; text after them is content).
- A run of tool messages becomes one user message of "Result of <name>:" blocks, since templates
  without tool support know no `tool` role; where the turn called that tool more than once, each
  block names its call's arguments, "Result of <name>(<arguments>):", to tell the results apart in
  whatever order the client sends them.

Messages come from chat.parse_messages (OpenAI's roles and any other a template knows; call
arguments already parsed); tools are OpenAI's `[{"type": "function", "function": {name, description, parameters}}]`.
"""

from __future__ import annotations

import json

from pagoda.tools.tags import parameters_of

INSTRUCTIONS = """You can call these tools:
{tools}

To call tools, answer with only a JSON object, no other text:
{{"tool_calls": [{{"name": "<tool name>", "arguments": {{<arguments>}}}}]}}
For example:
{example}
If no tool is needed, answer normally."""

# placeholder argument values for the example call, by JSON schema type
EXAMPLE_VALUES = {"string": "...", "integer": 1, "number": 1.5, "boolean": True, "array": [], "object": {}}


def with_tools_in_system_prompt(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """`messages` with the tools described in the system message and tool turns written as text."""
    rendered = _tool_turns_as_text(messages)
    if not tools:
        return rendered
    text = tool_instructions(tools)
    if rendered and rendered[0]["role"] == "system":
        return [{"role": "system", "content": f"{text}\n\n{rendered[0]['content']}"}, *rendered[1:]]
    return [{"role": "system", "content": text}, *rendered]


def tool_instructions(tools: list[dict]) -> str:
    functions = [tool["function"] for tool in tools]
    listing = "\n".join(_describe(function) for function in functions)
    return INSTRUCTIONS.format(tools=listing, example=calls_text([_example_call(functions[0])]))


def calls_text(calls: list[dict]) -> str:
    """Calls (`{"name", "arguments"}`) as the model is told to write them."""
    return json.dumps({"tool_calls": calls}, ensure_ascii=False)


def _describe(function: dict) -> str:
    description = function.get("description")
    head = f"- {function['name']}: {description}" if description else f"- {function['name']}"
    return f"{head}\n  parameters: {json.dumps(_untitled(parameters_of(function)))}"


NAMED_SCHEMAS = ("properties", "patternProperties", "$defs", "definitions")  # maps of names to schemas
VALUES = ("default", "const", "enum", "examples")  # JSON values, not schemas: kept as they are


def _untitled(schema: object) -> object:
    """A schema without its `title` annotations (pydantic titles a tool's arguments `get_weather_args`,
    a name a small model then calls); a property named "title" stays."""
    if isinstance(schema, list):
        return [_untitled(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    return {
        key: {name: _untitled(sub) for name, sub in value.items()}
        if key in NAMED_SCHEMAS and isinstance(value, dict)
        else value
        if key in VALUES
        else _untitled(value)
        for key, value in schema.items()
        if not (key == "title" and isinstance(value, str))
    }


def _example_call(function: dict) -> dict:
    properties = (function.get("parameters") or {}).get("properties") or {}
    arguments = {name: EXAMPLE_VALUES.get(_first_type(schema), "...") for name, schema in properties.items()}
    return {"name": function["name"], "arguments": arguments}


def _first_type(schema: object) -> str | None:
    """A property's JSON type: the first of a list such as ["string", "null"]."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(kind, list):
        kind = next((k for k in kind if isinstance(k, str)), None)
    return kind if isinstance(kind, str) else None


def _tool_turns_as_text(messages: list[dict]) -> list[dict]:
    calls: dict[str, dict] = {}  # tool call id -> its function ({"name", "arguments"}), to label its result
    repeated: set[str] = set()  # the tools the latest calling turn called more than once
    out: list[dict] = []
    for i, message in enumerate(messages):
        if message["role"] == "assistant" and message.get("tool_calls"):
            functions = [call["function"] for call in message["tool_calls"]]
            calls.update((call["id"], call["function"]) for call in message["tool_calls"])
            names = [function["name"] for function in functions]
            repeated = {name for name in names if names.count(name) > 1}
            content = "\n".join(text for text in (calls_text(functions), message["content"]) if text)
            out.append({"role": "assistant", "content": content})
        elif message["role"] == "tool":
            label = _result_label(message, calls.get(message["tool_call_id"]), repeated)
            block = f"Result of {label}:\n{message['content']}"
            if i > 0 and messages[i - 1]["role"] == "tool":
                out[-1] = {"role": "user", "content": f"{out[-1]['content']}\n\n{block}"}
            else:
                out.append({"role": "user", "content": block})
        else:
            out.append(message)  # as it is: its name and any field a template reads
    return out


def _result_label(result: dict, call: dict | None, repeated: set[str]) -> str:
    """The tool a result answers (its own `name`, else its call's), and its call's arguments where
    the turn called that tool more than once."""
    name = result.get("name") or (call["name"] if call is not None else "the tool")
    if call is None or call["name"] not in repeated:
        return name
    return f"{name}({json.dumps(call['arguments'], ensure_ascii=False)})"
