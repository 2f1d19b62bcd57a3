"""The Responses API (POST /v1/responses) through a real server and the official clients: the same
answers as the chat completion it translates to, streamed events that rebuild the whole response,
structured output, function calls and an agent loop's second turn, LangChain's Responses mode, and
bad input as 400s that name the Responses field."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.server.helpers import API_KEY, MODEL

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"],
    },
}
ASK = "What is the weather in Paris?"
COLOR = {
    "type": "object",
    "properties": {"color": {"type": "string", "maxLength": 12}, "warm": {"type": "boolean"}},
    "required": ["color", "warm"],
    "additionalProperties": False,
}


def chat_text(client, messages, max_tokens: int) -> tuple[str, str, object]:
    choice = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0)
    return choice.choices[0].message.content, choice.choices[0].finish_reason, choice.usage


def test_a_text_response_is_the_chat_completions_answer(client):
    """Greedy, instructions as the system message: the same text and token counts as chat."""
    response = client.responses.create(
        model=MODEL, instructions="Answer briefly.", input="Name three fruits.", max_output_tokens=24, temperature=0
    )
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name three fruits."}]
    text, finish, usage = chat_text(client, messages, 24)
    assert response.id.startswith("resp_") and response.object == "response" and response.model == MODEL
    assert response.output_text == text and [item.type for item in response.output] == ["message"]
    assert response.status == ("incomplete" if finish == "length" else "completed")
    assert (response.usage.input_tokens, response.usage.output_tokens) == (usage.prompt_tokens, usage.completion_tokens)
    cut = client.responses.create(model=MODEL, input="Tell me a long story.", max_output_tokens=3, temperature=0)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.output[0].status == "incomplete" and cut.usage.output_tokens == 3


def test_input_items_are_the_conversation(client):
    """Messages as items with text parts, an assistant turn in output_text parts: chat's answer."""
    items = [
        {"type": "message", "role": "developer", "content": "Answer briefly."},
        {"role": "user", "content": [{"type": "input_text", "text": "Name a fruit."}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Apple."}]},
        {"role": "user", "content": "Another one?"},
    ]
    response = client.responses.create(model=MODEL, input=items, max_output_tokens=16, temperature=0)
    messages = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Name a fruit."},
        {"role": "assistant", "content": "Apple."},
        {"role": "user", "content": "Another one?"},
    ]
    assert response.output_text == chat_text(client, messages, 16)[0]


def test_a_stream_rebuilds_the_whole_response(client):
    whole = client.responses.create(model=MODEL, input="Name three fruits.", max_output_tokens=20, temperature=0)
    with client.responses.stream(model=MODEL, input="Name three fruits.", max_output_tokens=20, temperature=0) as s:
        events = list(s)
        final = s.get_final_response()
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert deltas == final.output_text == whole.output_text
    assert final.status == whole.status and final.usage.output_tokens == whole.usage.output_tokens


def test_text_format_json_schema_holds(client):
    response = client.responses.create(
        model=MODEL,
        input="Describe the color of the sun as JSON.",
        text={"format": {"type": "json_schema", "name": "color", "schema": COLOR, "strict": True}},
        max_output_tokens=60,
        temperature=0.8,
        extra_body={"seed": 1},  # vLLM's field
    )
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), COLOR)


def test_a_forced_call_then_its_result(client):
    """A named function forced: a function_call item whose arguments fit its schema, streamed the
    same; its result sent back as a function_call_output item answers in the second turn."""
    choice = {"type": "function", "name": "get_weather"}
    first = client.responses.create(
        model=MODEL, input=ASK, tools=[WEATHER], tool_choice=choice, max_output_tokens=60, temperature=0
    )
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id and first.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    with client.responses.stream(
        model=MODEL, input=ASK, tools=[WEATHER], tool_choice=choice, max_output_tokens=60, temperature=0
    ) as s:
        streamed = s.get_final_response()
    assert [(i.type, i.name, i.arguments) for i in streamed.output] == [(call.type, call.name, call.arguments)]
    history = [
        {"role": "user", "content": ASK},
        call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"},
    ]
    second = client.responses.create(
        model=MODEL, input=history, tools=[WEATHER], tool_choice="none", max_output_tokens=30, temperature=0
    )
    messages = [
        {"role": "user", "content": ASK},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21 C"},
    ]
    chat = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=[{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}],
        tool_choice="none",
        max_tokens=30,
        temperature=0,
    )
    assert second.output_text == chat.choices[0].message.content


def test_what_openais_agents_sdk_sends_for_a_stateless_run(client):
    """Its store=False runs include reasoning.encrypted_content (taken, giving nothing, as vLLM); an
    allowed_tools choice forces a call among the allowed tools, as the chat endpoint's does."""
    other = {**WEATHER, "name": "get_forecast"}
    allowed = {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "get_weather"}]}
    answer = client.responses.create(
        model=MODEL,
        input=ASK,
        tools=[other, WEATHER],
        tool_choice=allowed,
        store=False,
        include=["reasoning.encrypted_content"],
        max_output_tokens=60,
        temperature=0,
    )
    calls = [item for item in answer.output if item.type == "function_call"]
    assert calls and {call.name for call in calls} == {"get_weather"}, answer.output


def test_logprobs_when_included(client):
    """include message.output_text.logprobs: one entry per output token, top_logprobs of each, the
    same streamed (on the text deltas) as whole."""
    asked = {
        "model": MODEL,
        "input": "Name a fruit.",
        "max_output_tokens": 6,
        "temperature": 0,
        "include": ["message.output_text.logprobs"],
        "top_logprobs": 2,
    }
    whole = client.responses.create(**asked)
    entries = whole.output[0].content[0].logprobs
    assert len(entries) == whole.usage.output_tokens == 6
    assert "".join(entry.token for entry in entries) == whole.output_text
    assert all(len(entry.top_logprobs) == 2 and entry.logprob <= 0 for entry in entries)
    assert whole.top_logprobs == 2  # echoed as asked
    with client.responses.stream(**asked) as s:
        events = list(s)
    streamed = [lp for event in events if event.type == "response.output_text.delta" for lp in event.logprobs]
    assert [(lp.token, lp.logprob) for lp in streamed] == [(lp.token, lp.logprob) for lp in entries]
    assert client.responses.create(model=MODEL, input="hi", max_output_tokens=2).output[0].content[0].logprobs == []


def test_vllms_fields_and_rules(client, small_server):
    """As vLLM's Responses API: its sampling extensions, truncation "auto" keeping the context's
    last tokens, an incomplete assistant message last continued, "auto" without tools, and tools
    without a tool_choice on a server without --enable-auto-tool-choice answered as text."""
    stopped = client.responses.create(
        model=MODEL, input="Count from 1 to 9.", max_output_tokens=30, temperature=0, extra_body={"stop": ["3"]}
    )
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Count from 1 to 9."}],
        max_tokens=30,
        temperature=0,
        stop=["3"],
    )
    assert stopped.output_text == chat.choices[0].message.content and "3" not in stopped.output_text
    long = client.responses.create(
        model=MODEL, input="word " * 3000, truncation="auto", max_output_tokens=2, temperature=0
    )
    assert long.usage.input_tokens == 2046 and long.usage.output_tokens == 2
    partial = [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "status": "incomplete", "content": [{"type": "output_text", "text": "The capital"}]},
    ]
    continued = client.responses.create(model=MODEL, input=partial, max_output_tokens=8, temperature=0)
    prefilled = client.chat.completions.create(
        model=MODEL,
        messages=[partial[0], {"role": "assistant", "content": "The capital"}],
        max_tokens=8,
        temperature=0,
        extra_body={"add_generation_prompt": False, "continue_final_message": True},
    )
    assert continued.output_text == prefilled.choices[0].message.content
    no_tools = client.responses.create(model=MODEL, input="hi", tool_choice="auto", max_output_tokens=2, temperature=0)
    assert no_tools.output_text and no_tools.tool_choice == "none"  # served with none, and says so
    plain = openai.OpenAI(base_url=f"{small_server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    answered = plain.responses.create(model=MODEL, input=ASK, tools=[WEATHER], max_output_tokens=8, temperature=0)
    assert [item.type for item in answered.output] == ["message"] and answered.tool_choice == "none"


def test_logprobs_of_an_answer_that_stops_on_its_own(client):
    """The end-of-sequence token has no text: its logprob still comes, streamed as whole."""
    asked = {
        "model": MODEL,
        "input": "Say just the word yes.",
        "max_output_tokens": 40,
        "temperature": 0,
        "include": ["message.output_text.logprobs"],
    }
    whole = client.responses.create(**asked)
    assert whole.status == "completed"
    with client.responses.stream(**asked) as s:
        streamed = s.get_final_response()
    entries = [(lp.token, lp.logprob) for lp in whole.output[0].content[0].logprobs]
    assert len(entries) == whole.usage.output_tokens
    assert [(lp.token, lp.logprob) for lp in streamed.output[0].content[0].logprobs] == entries


def test_items_keep_the_order_the_model_wrote_them_in():
    """Text, a call, more text: three items in that order, as a stream adds them; a call cut short
    is marked incomplete (an agent must not run it)."""
    from pagoda.entrypoints.openai.responses import _Items

    items = _Items()
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a"'}}
    for delta in ({"content": "Sure."}, {"tool_calls": [call]}, {"content": "Done."}):
        items.feed(delta)
    items.finish(incomplete=False)
    assert [(i["type"], i["status"]) for i in items.items] == [
        ("message", "completed"),
        ("function_call", "completed"),
        ("message", "completed"),
    ]
    cut = _Items()
    cut.feed({"tool_calls": [call]})
    cut.finish(incomplete=True)
    assert [(i["type"], i["arguments"], i["status"]) for i in cut.items] == [("function_call", '{"a"', "incomplete")]


CALL_THEN_TEXT = (
    r'\{"tool_calls": \[\{"name": "get_weather", "arguments": \{"city": "Rome", "unit": "celsius"\}\}\]\}'
    r" Done\."
)


def test_text_after_a_call_is_an_item_after_it_whole_and_streamed(client, http):
    """The model writes a call, then text (forced here by a regex under tool_choice auto): the
    function call is the first item and the text one message after it, streamed or not; a chat
    stream sends the call's delta before the text's."""
    body = {"input": ASK, "tools": [WEATHER], "temperature": 0, "max_output_tokens": 60}
    extra = {"structured_outputs": {"regex": CALL_THEN_TEXT}}
    whole = client.responses.create(model=MODEL, **body, extra_body=extra)
    with client.responses.stream(model=MODEL, **body, extra_body=extra) as stream:
        streamed = stream.get_final_response()
    for response in (whole, streamed):
        assert [item.type for item in response.output] == ["function_call", "message"], response.output
        assert response.output[1].content[0].text == " Done."
    chat = {
        "model": MODEL,
        "messages": [{"role": "user", "content": ASK}],
        "tools": [{"type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters")}}],
        "tool_choice": "auto",
        "temperature": 0,
        "max_tokens": 60,
        "stream": True,
        **extra,
    }
    kinds = []
    with http.stream("POST", "/v1/chat/completions", json=chat) as events:
        for line in events.iter_lines():
            if line.startswith("data: {"):
                delta = json.loads(line[6:])["choices"][0]["delta"]
                kinds += [kind for kind in ("tool_calls", "content") if delta.get(kind)]
    assert kinds[0] == "tool_calls" and set(kinds[1:]) == {"content"}, kinds


def test_langchain_in_responses_mode(server):
    langchain_openai = pytest.importorskip("langchain_openai")

    llm = langchain_openai.ChatOpenAI(
        model=MODEL,
        base_url=f"{server.base_url}/v1",
        api_key=API_KEY,
        temperature=0,
        max_tokens=60,
        max_retries=0,
        use_responses_api=True,
    )
    message = llm.bind_tools([WEATHER], tool_choice="get_weather").invoke(ASK)
    assert [call["name"] for call in message.tool_calls] == ["get_weather"]
    assert llm.invoke("Say hi.").text


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": "hi", "background": True}, "background"),
        ({"input": [{"type": "input_image", "image_url": "http://x"}]}, "input[0].type"),
        ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input[0].content[0].type"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
        ({"input": [{"type": "function_call", "call_id": "c1", "arguments": "{}"}]}, "input[0].name"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": "hi", "tools": [{"type": "function", "name": "bad name!"}]}, "tools[0].name"),
        ({"input": "hi", "tool_choice": {"type": "mcp"}}, "tool_choice"),
        ({"input": "hi", "tool_choice": "bogus"}, "tool_choice"),
        ({"input": "hi", "text": {"format": 3}}, "text.format.type"),
        ({"input": []}, "input"),
        ({"input": "hi", "text": {"format": {"type": "xml"}}}, "text.format.type"),
        ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": 3}}}, "text.format"),
        ({"input": "hi", "max_output_tokens": 10**6}, "max_output_tokens"),
        ({"input": "hi", "include": ["message.output_audio"]}, "include"),
        ({"input": "hi", "text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format"),
        ({"input": "hi", "text": {"format": "json"}}, "text.format.type"),
        ({"input": "hi", "top_logprobs": -3}, "top_logprobs"),
        ({"input": "hi", "reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(http, body, param):
    answer = http.post("/v1/responses", json={"model": MODEL, **body})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert http.post("/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 2}).status_code == 200


def test_a_stored_responses_routes_say_none_is_stored(client, http):
    """Nothing is stored: retrieving, deleting, cancelling or listing a response's input is a 404
    naming the id (the openai client raises NotFoundError), as vLLM without its store answers."""
    made = client.responses.create(model=MODEL, input="hi", max_output_tokens=2)
    with pytest.raises(openai.NotFoundError) as raised:
        client.responses.retrieve(made.id)
    assert raised.value.body["param"] == "response_id" and made.id in raised.value.body["message"]
    for method, path in [("DELETE", ""), ("POST", "/cancel"), ("GET", "/input_items")]:
        answer = http.request(method, f"/v1/responses/{made.id}{path}")
        assert answer.status_code == 404 and answer.json()["error"]["param"] == "response_id", answer.text


def test_a_stream_that_fails_ends_with_openais_failure_events():
    """A generation that fails after the stream began (the server shutting down): the text held
    back (a possible <think> tag) and the open message done as cut short, OpenAI's error event
    (its fields nested too: the openai client raises on it), then response.failed, last."""
    import asyncio
    from types import SimpleNamespace

    from pagoda.entrypoints.openai.errors import APIError
    from pagoda.entrypoints.openai.responses import _events
    from pagoda.entrypoints.openai.tool_calls import ToolPlan
    from pagoda.tools.reasoning import ReasoningParser

    class Failing:
        async def updates(self):
            yield 0, SimpleNamespace(text_delta="Hel", logprobs_delta=[], logprobs=[], finished=False)
            yield 0, SimpleNamespace(text_delta="lo <thi", logprobs_delta=[], logprobs=[], finished=False)
            raise APIError(503, "The server is shutting down")

    async def events() -> list[str]:
        stream = _events(ToolPlan(reasoning=ReasoningParser()), Failing(), {"id": "resp_1"}, lambda *_: [], None)
        return [event async for event in stream]

    parsed = [json.loads(event.split("data: ", 1)[1]) for event in asyncio.run(events())]
    kinds = [event["type"] for event in parsed]
    assert kinds[-4:] == ["response.content_part.done", "response.output_item.done", "error", "response.failed"]
    assert [event["sequence_number"] for event in parsed] == list(range(len(parsed)))
    error, failed = parsed[-2], parsed[-1]["response"]
    assert error["code"] == "server_error" and error["message"] == "The server is shutting down"
    assert error["error"]["message"] == error["message"] and error["error"]["type"] == "server_error"
    assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
    assert [(item["type"], item["status"], item["content"][0]["text"]) for item in failed["output"]] == [
        ("message", "incomplete", "Hello <thi")
    ]


def test_with_vllms_store_previous_response_id_continues_a_conversation(small_server):
    """VLLM_ENABLE_RESPONSES_API_STORE=1: a stored response is found by id, a later request's
    previous_response_id puts its input and output before the new input (not its instructions), a
    call's output answers it across turns, and DELETE forgets it; store false stores nothing."""
    client = openai.OpenAI(base_url=f"{small_server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    http = client._client  # the same connection, for the raw routes
    first = client.responses.create(model=MODEL, input="My name is Ada.", instructions="Be brief.", max_output_tokens=8)
    assert first.store and client.responses.retrieve(first.id).output[0].content[0].text == first.output_text
    second = client.responses.create(
        model=MODEL, input="What is my name?", previous_response_id=first.id, max_output_tokens=4
    )
    assert second.previous_response_id == first.id
    turns = [
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"},
    ]
    rendered = http.post(f"{small_server.base_url}/tokenize", json={"messages": turns}).json()["count"]
    assert second.usage.input_tokens == rendered  # the first turn's instructions are not carried over
    listed = client.responses.input_items.list(second.id, order="asc")  # OpenAI's shapes, ids and parts
    assert [(item.role, item.content[0].type) for item in listed.data] == [
        ("user", "input_text"),
        ("assistant", "output_text"),
        ("user", "input_text"),
    ]
    assert all(item.id for item in listed.data) and listed.first_id == listed.data[0].id
    newest = client.responses.input_items.list(second.id, limit=1)  # newest first by default
    assert newest.data[0].content[0].text == "What is my name?" and newest.has_more
    called = client.responses.create(
        model=MODEL, input=ASK, tools=[WEATHER], tool_choice="required", max_output_tokens=60
    )
    call = called.output[0]
    answered = client.responses.create(
        model=MODEL,
        previous_response_id=called.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": '{"temp": 21}'}],
        max_output_tokens=4,
    )
    assert answered.status in ("completed", "incomplete") and answered.output
    assert http.delete(f"{small_server.base_url}/v1/responses/{first.id}").json()["deleted"] is True
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as unknown:
        client.responses.create(model=MODEL, input="hi", previous_response_id=first.id, max_output_tokens=1)
    assert unknown.value.body["param"] == "previous_response_id"
    bad = {"model": MODEL, "input": [{"type": "input_image", "image_url": "http://x"}], "max_output_tokens": 1}
    refused = http.post(f"{small_server.base_url}/v1/responses", json=bad)  # checked before it is kept
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "input[0].type", refused.text
    unstored = client.responses.create(model=MODEL, input="hi", store=False, max_output_tokens=1)
    assert not unstored.store
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
