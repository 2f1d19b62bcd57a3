"""pagoda.tools.prompt: the generic format's system prompt, and earlier tool turns as text."""

from __future__ import annotations

import json

from pagoda.tools.prompt import calls_text, tool_instructions, with_tools_in_system_prompt

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time"}}
CALL = {"type": "function", "id": "call_1", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}


def test_instructions_list_each_tool_and_show_the_format_with_an_example():
    text = tool_instructions([WEATHER, CLOCK])
    assert "- get_weather: The current weather in a city." in text
    assert json.dumps(WEATHER["function"]["parameters"]) in text
    assert "- get_time\n  parameters: " + json.dumps({"type": "object", "properties": {}}) in text
    assert '{"tool_calls": [{"name": "<tool name>", "arguments": {<arguments>}}]}' in text
    example = json.loads(text.split("For example:\n")[1].splitlines()[0])
    assert example == {"tool_calls": [{"name": "get_weather", "arguments": {"city": "...", "days": 1}}]}


def test_tools_go_before_an_existing_system_message():
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Weather?"}]
    rendered = with_tools_in_system_prompt(messages, [WEATHER])
    assert rendered[0] == {"role": "system", "content": tool_instructions([WEATHER]) + "\n\nBe terse."}
    assert rendered[1:] == messages[1:]


def test_without_a_system_message_the_tools_are_a_new_first_message():
    messages = [{"role": "user", "content": "Weather?"}]
    assert with_tools_in_system_prompt(messages, [WEATHER]) == [
        {"role": "system", "content": tool_instructions([WEATHER])},
        *messages,
    ]


def test_earlier_calls_and_results_become_text_in_the_same_format():
    clock = {"type": "function", "id": "call_2", "function": {"name": "get_time", "arguments": {}}}
    messages = [
        {"role": "user", "content": "Weather and time in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [CALL, clock]},
        {"role": "tool", "content": '{"temp": 21}', "tool_call_id": "call_1"},
        {"role": "tool", "content": "noon", "tool_call_id": "call_2", "name": "clock"},
        {"role": "assistant", "content": "Looking again.", "tool_calls": [CALL]},
        {"role": "tool", "content": "rain", "tool_call_id": "call_1"},
        {"role": "user", "content": "Thanks."},
    ]
    calls = [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]
    assert with_tools_in_system_prompt(messages, None) == [
        messages[0],
        {"role": "assistant", "content": calls_text(calls)},
        {
            "role": "user",
            "content": 'Result of get_weather:\n{"temp": 21}\n\nResult of clock:\nnoon',
        },
        {"role": "assistant", "content": calls_text(calls[:1]) + "\nLooking again."},
        {"role": "user", "content": "Result of get_weather:\nrain"},
        messages[-1],
    ]
    assert calls_text(calls[:1]) == '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}'


def test_results_of_parallel_calls_of_one_tool_are_told_apart_by_their_arguments():
    """Two calls of get_weather answered in the other order: each result names its call's arguments
    (written as the calls are, non-ASCII as itself)."""
    rome = {"type": "function", "id": "call_9", "function": {"name": "get_weather", "arguments": {"city": "Roma é"}}}
    messages = [
        {"role": "user", "content": "Paris and Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL, rome]},
        {"role": "tool", "content": "rainy", "tool_call_id": "call_9"},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
        {"role": "tool", "content": "late", "tool_call_id": "call_unknown"},
    ]
    assert with_tools_in_system_prompt(messages, None)[-1]["content"] == (
        'Result of get_weather({"city": "Roma é"}):\nrainy\n\n'
        'Result of get_weather({"city": "Paris"}):\nsunny\n\n'
        "Result of the tool:\nlate"
    )
    assert '"Roma é"' in with_tools_in_system_prompt(messages, None)[1]["content"]  # the call as the label


def test_an_earlier_turn_of_text_and_calls_reads_back_as_both():
    """Written calls first, then the text: the layout the generic parser reads as those calls and
    that content, so the history shows the model a form its answers are read in."""
    from pagoda.tools.parsers import get_parser

    messages = [{"role": "assistant", "content": "Looking it up.", "tool_calls": [CALL]}]
    written = with_tools_in_system_prompt(messages, None)[0]["content"]
    parsed = get_parser("generic").parse(written)
    calls = [(call.name, json.loads(call.arguments)) for call in parsed.tool_calls]
    assert calls == [("get_weather", {"city": "Paris"})]
    assert parsed.content.strip() == "Looking it up."


def test_the_schema_shown_has_no_title_annotations():
    """pydantic titles a tool's arguments `get_weather_args`, a name a small model then calls."""
    parameters = {
        "title": "get_weather_args",
        "type": "object",
        "properties": {"title": {"title": "Title", "type": "string"}, "unit": {"default": {"title": "kept"}}},
    }
    shown = tool_instructions([{"type": "function", "function": {"name": "get_weather", "parameters": parameters}}])
    assert "get_weather_args" not in shown and '"Title"' not in shown
    assert '"title": {"type": "string"}' in shown and '{"title": "kept"}' in shown
