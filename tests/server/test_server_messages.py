"""Anthropic's Messages API (POST /v1/messages) through a real server and Anthropic's official
client (its key sent as X-Api-Key): the same answers as the chat completion it translates to, a
stream that rebuilds the whole message, stop sequences, a forced tool call and its result in the
second turn, JSON output, count_tokens, and bad input as Anthropic's 400s."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest

from tests.server.helpers import API_KEY, MODEL

pytestmark = pytest.mark.slow

WEATHER = {
    "name": "get_weather",
    "description": "The current weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"],
    },
}
ASK = "What is the weather in Paris?"
FRUITS = [{"role": "user", "content": "Name three fruits."}]


@pytest.fixture(scope="module")
def claude(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=120)


GREEDY = {"temperature": 0}  # a body field: Anthropic's newest client has no sampling arguments


def chat(client, messages, max_tokens: int, **fields):
    return client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0, **fields
    )


def test_a_message_is_the_chat_completions_answer(claude, client):
    """Greedy, the system prompt as chat's system message (a string or text blocks alike): the
    same text and token counts as chat, stop_reason end_turn or max_tokens."""
    message = claude.messages.create(
        model=MODEL, system="Answer briefly.", messages=FRUITS, max_tokens=24, extra_body=GREEDY
    )
    answer = chat(client, [{"role": "system", "content": "Answer briefly."}, *FRUITS], 24)
    assert message.id.startswith("msg_") and message.type == "message" and message.role == "assistant"
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == answer.choices[0].message.content
    assert message.stop_reason == ("max_tokens" if answer.choices[0].finish_reason == "length" else "end_turn")
    used = message.usage
    assert used.input_tokens + used.cache_read_input_tokens == answer.usage.prompt_tokens
    assert used.output_tokens == answer.usage.completion_tokens
    blocks = [{"type": "text", "text": "Answer briefly.", "cache_control": {"type": "ephemeral"}}]
    again = claude.messages.create(model=MODEL, system=blocks, messages=FRUITS, max_tokens=24, extra_body=GREEDY)
    assert again.content[0].text == message.content[0].text
    cut = claude.messages.create(model=MODEL, messages=FRUITS, max_tokens=2, extra_body=GREEDY)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 2


def test_a_final_assistant_text_is_continued(claude, client):
    """Anthropic's prefill: a conversation that ends with the assistant's text is continued from it,
    the answer's content what follows it (chat's continue_final_message), streamed alike; counted alike."""
    prefill = {"role": "assistant", "content": '{"name": "'}
    messages = [{"role": "user", "content": "Give JSON for a cat."}, prefill]
    message = claude.messages.create(model=MODEL, messages=messages, max_tokens=12, extra_body=GREEDY)
    continued = chat(client, messages, 12, extra_body={"continue_final_message": True, "add_generation_prompt": False})
    answered = chat(client, messages[:1], 12)
    assert message.content[0].text == continued.choices[0].message.content != answered.choices[0].message.content
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == continued.usage.prompt_tokens
    blocks = [messages[0], {"role": "assistant", "content": [{"type": "text", "text": prefill["content"]}]}]
    with claude.messages.stream(model=MODEL, messages=blocks, max_tokens=12, extra_body=GREEDY) as stream:
        assert stream.get_final_message().content[0].text == message.content[0].text
    counted = claude.messages.count_tokens(model=MODEL, messages=messages)
    assert counted.input_tokens == continued.usage.prompt_tokens


def test_a_stream_rebuilds_the_whole_message(claude):
    whole = claude.messages.create(model=MODEL, messages=FRUITS, max_tokens=20, extra_body=GREEDY)
    with claude.messages.stream(model=MODEL, messages=FRUITS, max_tokens=20, extra_body=GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [event.type for event in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
    deltas = "".join(e.delta.text for e in events if e.type == "content_block_delta" and e.delta.type == "text_delta")
    assert deltas == final.content[0].text == whole.content[0].text
    assert (final.stop_reason, final.usage.output_tokens) == (whole.stop_reason, whole.usage.output_tokens)


def test_a_stop_sequence_ends_the_message_and_is_named(claude):
    text = claude.messages.create(model=MODEL, messages=FRUITS, max_tokens=20, extra_body=GREEDY).content[0].text
    stop = text.split()[1]  # a word the greedy answer writes
    message = claude.messages.create(
        model=MODEL, messages=FRUITS, max_tokens=20, extra_body=GREEDY, stop_sequences=[stop]
    )
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert stop not in message.content[0].text and text.startswith(message.content[0].text)
    nothing = claude.messages.create(
        model=MODEL, messages=FRUITS, max_tokens=20, extra_body=GREEDY, stop_sequences=[text.split()[0]]
    )
    assert [(b.type, b.text.strip()) for b in nothing.content] == [("text", "")]  # vLLM's: never no block


def test_a_forced_tool_call_then_its_result(claude, client):
    """A named tool forced: a tool_use block whose input fits its schema, stop_reason tool_use,
    streamed the same; its tool_result sent back answers as chat answers the same history."""
    choice = {"type": "tool", "name": "get_weather"}
    ask = [{"role": "user", "content": ASK}]
    first = claude.messages.create(
        model=MODEL, messages=ask, tools=[WEATHER], tool_choice=choice, max_tokens=60, extra_body=GREEDY
    )
    (call,) = first.content
    assert call.type == "tool_use" and call.name == "get_weather" and first.stop_reason == "tool_use"
    jsonschema.validate(call.input, WEATHER["input_schema"])
    with claude.messages.stream(
        model=MODEL, messages=ask, tools=[WEATHER], tool_choice=choice, max_tokens=60, extra_body=GREEDY
    ) as stream:
        streamed = stream.get_final_message()
    assert [(b.type, b.name, b.input) for b in streamed.content] == [(call.type, call.name, call.input)]
    history = [
        *ask,
        {"role": "assistant", "content": [call.model_dump(exclude_none=True)]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "sunny, 21 C"}]},
    ]
    second = claude.messages.create(
        model=MODEL, messages=history, tools=[WEATHER], tool_choice={"type": "none"}, max_tokens=30, extra_body=GREEDY
    )
    arguments = json.dumps(call.input, ensure_ascii=False)
    messages = [
        *ask,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": arguments}}
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    tool = {"type": "function", "function": {"name": WEATHER["name"], "parameters": WEATHER["input_schema"]}}
    tool["function"]["description"] = WEATHER["description"]
    answer = chat(client, messages, 30, tools=[tool], tool_choice="none")
    assert second.content[0].text == answer.choices[0].message.content


def test_output_config_json_schema_and_count_tokens(claude, http):
    schema = {"type": "object", "properties": {"color": {"type": "string", "maxLength": 12}}, "required": ["color"]}
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "The color of the sun, as JSON."}],
        "max_tokens": 40,
        "temperature": 0,
        "output_config": {"format": {"type": "json_schema", "schema": schema}},
    }
    message = http.post("/v1/messages", json=body).json()
    jsonschema.validate(json.loads(message["content"][0]["text"]), schema)
    counted = claude.messages.count_tokens(model=MODEL, system="Answer briefly.", messages=FRUITS)
    sent = claude.messages.create(model=MODEL, system="Answer briefly.", messages=FRUITS, max_tokens=1)
    assert counted.input_tokens == sent.usage.input_tokens + sent.usage.cache_read_input_tokens > 5


@pytest.mark.parametrize(
    "change, param",
    [
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages[0].content[0]"),
        ({"messages": [{"role": "tool", "content": "hi"}]}, "messages[0].role"),
        # the chat path's 400s, named as the Messages request names the place (system first: no shift)
        (
            {
                "system": "Be brief.",
                "messages": [
                    *FRUITS,
                    {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
                    {"role": "user", "content": [{"type": "tool_result", "content": "x"}]},
                ],
            },
            "messages[2].content[0].tool_use_id",
        ),
        ({"tools": [{"name": "f", "input_schema": {"type": "nonsense"}}]}, "tools[0].input_schema"),
        ({"output_config": {"effort": "bogus"}}, "output_config.effort"),
        ({"tool_choice": {"type": "any"}}, "tool_choice.type"),  # no tools to choose from
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking.budget_tokens"),  # not below max_tokens
        ({"tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
        ({"messages": [*FRUITS, {"role": "assistant", "content": "Apple, "}]}, "messages[1].content"),  # a prefill
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0]"),
        ({"output_config": {"format": {"type": "xml"}}}, "output_config.format"),
        (  # Anthropic's structured outputs are strict: what the grammar cannot enforce is refused
            {"output_config": {"format": {"type": "json_schema", "schema": {"type": "array", "uniqueItems": True}}}},
            "output_config.format",
        ),
    ],
)
def test_bad_input_is_anthropics_400_naming_the_place(server, change, param):
    body = {"model": MODEL, "messages": FRUITS, "max_tokens": 8, **change}
    answer = httpx.post(f"{server.base_url}/v1/messages", json=body, headers={"x-api-key": API_KEY}, timeout=60)
    assert answer.status_code == 400
    error = answer.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert param in error["error"]["message"]
    assert f"rejected POST /v1/messages: 400 {error['error']['message'][:40]}" in server.log()


def test_system_messages_and_text_blocks_render_as_vllm_renders_them(claude):
    """A system-role message joins the system prompt (as Claude Code's reminders come), and text
    blocks are joined by newlines, as the chat path joins text parts."""

    def count(**fields) -> int:
        return claude.messages.count_tokens(model=MODEL, **fields).input_tokens

    merged = [{"role": "system", "content": "Be brief."}, *FRUITS]
    assert count(system="Be kind.", messages=merged) == count(system="Be kind.\nBe brief.", messages=FRUITS)
    blocks = [{"role": "user", "content": [{"type": "text", "text": "Line one."}, {"type": "text", "text": "Two."}]}]
    assert count(messages=blocks) == count(messages=[{"role": "user", "content": "Line one.\nTwo."}])


def test_the_key_is_needed_as_x_api_key_or_bearer(server):
    unkeyed = anthropic.Anthropic(base_url=server.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        unkeyed.messages.create(model=MODEL, messages=FRUITS, max_tokens=1)
    bearer = anthropic.Anthropic(base_url=server.base_url, auth_token=API_KEY, max_retries=0)
    assert bearer.messages.create(model=MODEL, messages=FRUITS, max_tokens=1).usage.output_tokens == 1


def test_blocks_keep_the_order_the_model_wrote_them_in():
    """Thinking, text, a call, more text: four blocks in that order, each started, grown and
    stopped before the next, as a stream sends them; a call's input is its arguments parsed, {}
    where they were cut short (the stop_reason says max_tokens)."""
    from pagoda.entrypoints.openai.messages import _Blocks

    blocks, events = _Blocks(), []
    whole = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": '}}
    rest = {"index": 0, "function": {"arguments": "1}"}}
    deltas = [{"reasoning": "Hm."}, {"content": "Sure."}, {"tool_calls": [whole]}, {"tool_calls": [rest]}]
    for delta in [*deltas, {"content": "Done."}]:
        events += blocks.feed(delta)
    events += blocks.close()
    assert blocks.blocks == [
        {"type": "thinking", "thinking": "Hm.", "signature": ""},
        {"type": "text", "text": "Sure."},
        {"type": "tool_use", "id": "call_1", "name": "f", "input": {"a": 1}},
        {"type": "text", "text": "Done."},
    ]
    kinds = [json.loads(event.split("data: ", 1)[1])["type"] for event in events]
    assert kinds == ["content_block_start", "content_block_delta", "content_block_stop"] * 2 + [
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
    ]
    cut = _Blocks()
    cut.feed({"tool_calls": [whole]})
    cut.close()
    assert cut.blocks == [{"type": "tool_use", "id": "call_1", "name": "f", "input": {}}]


def test_a_whole_answer_keeps_text_a_call_and_text_in_the_order_written():
    """Built update by update as a stream is (a parser that holds a call back until it is whole
    would otherwise put all the text first when fed the whole output at once)."""
    import asyncio

    from pagoda.engine.outputs import SequenceOutput
    from pagoda.entrypoints.openai.messages import _Answer
    from pagoda.entrypoints.openai.tool_calls import ToolSettings, plan_tools

    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    plan = plan_tools([tool], "auto", True, ToolSettings(enable_auto_tool_choice=True), "{{ tools }}<tool_call>")
    pieces = ["Let me check.", '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>', "Then more."]

    class Scripted:
        async def updates(self):
            for i, piece in enumerate(pieces):
                last = i == len(pieces) - 1
                yield 0, SequenceOutput("m", 0, text_delta=piece, finish_reason="stop" if last else None)

    async def build() -> _Answer:
        answer = _Answer(plan)
        async for _ in answer.events(Scripted()):
            pass
        answer.blocks.finish()
        return answer

    answer = asyncio.run(build())
    assert [(b["type"], b.get("text"), b.get("input")) for b in answer.blocks.blocks] == [
        ("text", "Let me check.", None),
        ("tool_use", None, {"a": 1}),
        ("text", "Then more.", None),
    ]
    assert answer.ending() == {"stop_reason": "tool_use", "stop_sequence": None}
