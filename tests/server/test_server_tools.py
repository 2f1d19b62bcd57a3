"""Tool calling through a real server: forced calls (required, a named function) that always parse
and validate, streamed calls equal to whole ones, an agent loop, real clients, and bad input."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.server.helpers import API_KEY, MODEL

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The current time in a time zone.",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}},
            "required": ["zone"],
        },
    },
}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris, and what time is it in Berlin?"}]


def assert_valid_calls(calls, allowed=tuple(SCHEMAS)) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id and call.function.name in allowed
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_required_always_gives_a_valid_call(client, seed):
    response = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=1.0,
        seed=seed,
        max_tokens=120,
    )
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    assert_valid_calls(choice.message.tool_calls)


@pytest.mark.parametrize("function", [{"name": "ping"}, {"name": "ping", "parameters": {}, "strict": True}])
def test_a_forced_tool_without_parameters_takes_none(client, function):
    """A tool without parameters (or with `{}`) takes none, as OpenAI documents and vLLM holds it: its forced
    call's arguments are `{}` however hot the sampling, never any object."""
    for seed in range(3):
        response = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Ping it."}],
            tools=[{"type": "function", "function": function}],
            tool_choice="required",
            parallel_tool_calls=False,
            temperature=1.5,
            seed=seed,
            max_tokens=60,
        )
        choice = response.choices[0]
        assert choice.finish_reason == "tool_calls", seed
        assert [call.function.arguments for call in choice.message.tool_calls] == ["{}"], seed


def test_required_with_parallel_calls(client):
    """Any number of calls (a sampled 135M model may go on calling until max_tokens: greedy here)."""
    response = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=300
    )
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert_valid_calls(choice.message.tool_calls)


def test_allowed_tools_required_calls_only_those(client):
    """OpenAI's allowed_tools: every tool is shown, "required" forces calls among the allowed ones."""
    allowed = {"mode": "required", "tools": [{"type": "function", "function": {"name": "get_time"}}]}
    kwargs = dict(model=MODEL, messages=ASK, tools=TOOLS, temperature=0, max_tokens=120)
    choice = client.chat.completions.create(
        **kwargs, tool_choice={"type": "allowed_tools", "allowed_tools": allowed}
    ).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert_valid_calls(choice.message.tool_calls, allowed=("get_time",))


# An agent's second turn, after which the 135M model calls get_weather under "auto" by itself.
BERLIN = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    {"role": "assistant", "content": "It is 18 C and sunny in Paris."},
    {"role": "user", "content": "What is the weather in Berlin?"},
]
KELVIN = {  # a unit the model would not write by itself
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["kelvin"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}


def weather_in_kelvin(strict: bool) -> dict:
    return {"type": "function", "function": {**WEATHER["function"], "parameters": KELVIN, "strict": strict}}


def auto_calls(client, **kwargs) -> list[tuple[str, dict]]:
    kwargs = dict(model=MODEL, messages=BERLIN, temperature=0, max_tokens=60) | kwargs
    choice = client.chat.completions.create(**kwargs).choices[0]
    return [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls or []]


def test_auto_holds_a_strict_tools_calls_to_its_schema(client):
    """OpenAI's `strict: true` under "auto" (as vLLM 0.32 serves it, with a structural tag): the model
    decides whether to call, and a call it opens must validate. The same tool not strict: the model's
    own arguments."""
    (name, arguments), *_ = auto_calls(client, tools=[weather_in_kelvin(strict=True), TIME])
    assert name == "get_weather"
    jsonschema.validate(arguments, KELVIN)
    (name, arguments), *_ = auto_calls(client, tools=[weather_in_kelvin(strict=False), TIME])
    assert name == "get_weather" and arguments.get("unit") != "kelvin"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(arguments, KELVIN)


def test_allowed_tools_auto_calls_only_those(client):
    """OpenAI's allowed_tools "auto": every tool is shown, the model decides, and a call is one of
    those allowed. Plain "auto" calls get_weather here. (One call: held to get_time, whose arguments
    are not, the 135M model goes on calling it until max_tokens.)"""
    assert [name for name, _ in auto_calls(client, tools=TOOLS, parallel_tool_calls=False)] == ["get_weather"]
    allowed = {"mode": "auto", "tools": [{"type": "function", "function": {"name": "get_time"}}]}
    choice = {"type": "allowed_tools", "allowed_tools": allowed}
    calls = auto_calls(client, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False)
    assert [name for name, _ in calls] == ["get_time"]


def test_a_strict_tool_beside_a_response_format_is_a_call_or_the_answer(client):
    """The OpenAI Agents SDK's output_type beside its (strict) tools: as vLLM 0.32, the output opens
    with a call held to its tool, or is the answer in its schema."""
    answer = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
    response_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": answer, "strict": True}}
    kwargs = dict(model=MODEL, messages=BERLIN, temperature=0, max_tokens=60, response_format=response_format)
    choice = client.chat.completions.create(**kwargs, tools=[weather_in_kelvin(strict=True), TIME]).choices[0]
    assert [call.function.name for call in choice.message.tool_calls] == ["get_weather"]
    jsonschema.validate(json.loads(choice.message.tool_calls[0].function.arguments), KELVIN)
    without_tools = client.chat.completions.create(**kwargs).choices[0]
    jsonschema.validate(json.loads(without_tools.message.content), answer)


def test_a_named_function_is_the_one_called(client):
    """Its whole call finishes "stop", streamed or not, as OpenAI's and vLLM's ("tool_calls" is for
    calls the model chose: "auto" and "required")."""
    forced = {"type": "function", "function": {"name": "get_time"}}
    kwargs = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=forced, max_tokens=80)
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert len(choice.message.tool_calls) == 1 and choice.finish_reason == "stop"
    assert_valid_calls(choice.message.tool_calls, allowed=("get_time",))
    chunks = [c.choices[0] for c in client.chat.completions.create(**kwargs, stream=True) if c.choices]
    assert [c.finish_reason for c in chunks if c.finish_reason] == ["stop"]
    assert [call.function.name for c in chunks for call in c.delta.tool_calls or [] if call.function.name] == [
        "get_time"
    ]


def test_a_forced_call_overrides_response_format(client):
    """OpenAI takes both; the forced call's grammar wins (vLLM's rule): its output is the call."""
    forced = {"type": "function", "function": {"name": "get_time"}}
    schema = {"type": "json_schema", "json_schema": {"name": "answer", "schema": {"type": "object"}}}
    response = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice=forced, response_format=schema, max_tokens=80
    )
    assert_valid_calls(response.choices[0].message.tool_calls, allowed=("get_time",))


@pytest.mark.parametrize("held", ["required", "a strict tool under auto"])
def test_streamed_calls_equal_whole_ones(client, held):
    """Calls a grammar holds (forced, or a strict tool's under "auto") stream as they are generated,
    and add up to the whole answer's."""
    kwargs = dict(model=MODEL, temperature=0, max_tokens=300)
    if held == "required":
        kwargs |= dict(messages=ASK, tools=TOOLS, tool_choice="required")
    else:
        kwargs |= dict(messages=BERLIN, tools=[weather_in_kelvin(strict=True), TIME])
    whole = client.chat.completions.create(**kwargs).choices[0]
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    pieces: dict[int, int] = {}  # deltas carrying a piece of a call's arguments
    finish = None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        for call in delta.tool_calls or []:
            if call.function.name:
                assert call.index not in names and call.id and call.type == "function"
                names[call.index] = call.function.name
            arguments[call.index] = arguments.get(call.index, "") + (call.function.arguments or "")
            pieces[call.index] = pieces.get(call.index, 0) + bool(call.function.arguments)
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" == whole.finish_reason
    assert [names[i] for i in sorted(names)] == [c.function.name for c in whole.message.tool_calls]
    assert [arguments[i] for i in sorted(arguments)] == [c.function.arguments for c in whole.message.tool_calls]
    # a held call's arguments stream as they are generated, a token or so a delta
    assert names and all(pieces[i] > 1 for i in names), pieces


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_call_cut_short_keeps_its_finish_reason(client, stream):
    """A forced call cut by max_tokens or a stop string is sent as far as it came, with the
    sequence's own finish reason: only whole calls finish as "tool_calls"."""
    base = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", temperature=0)
    whole = client.chat.completions.create(**base, max_tokens=300).choices[0]
    assert whole.finish_reason == "tool_calls"
    city = json.loads(whole.message.tool_calls[0].function.arguments)["city"]
    for cut, reason in ((dict(max_tokens=whole_tokens(client, base) - 4), "length"), (dict(stop=[city]), "stop")):
        if stream:
            chunks = list(client.chat.completions.create(**base, **cut, stream=True))
            finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
            arguments = "".join(
                call.function.arguments or ""
                for c in chunks
                if c.choices
                for call in c.choices[0].delta.tool_calls or []
            )
            assert finish == [reason] and arguments, cut
        else:
            choice = client.chat.completions.create(**base, **cut).choices[0]
            assert choice.finish_reason == reason and choice.message.tool_calls, cut
            arguments = "".join(call.function.arguments for call in choice.message.tool_calls)
        assert whole.message.tool_calls[0].function.arguments.startswith(arguments[: len(arguments) // 2] or "{")


def whole_tokens(client, base) -> int:
    return client.chat.completions.create(**base, max_tokens=300).usage.completion_tokens


def test_a_two_turn_agent_loop(client):
    """Greedy: sampled, this model may keep adding calls until max_tokens cuts the list, and a cut
    forced list comes back as content (docs/tools.md); which sample it draws depends on what the
    shared server served before."""
    first = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=300, temperature=0
    ).choices[0]
    calls = first.message.tool_calls
    assert calls and first.finish_reason == "tool_calls"
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in calls]},
        *[{"role": "tool", "tool_call_id": c.id, "content": json.dumps({"result": "sunny, 21 C"})} for c in calls],
    ]
    final = client.chat.completions.create(
        model=MODEL, messages=history, tools=TOOLS, tool_choice="none", max_tokens=40
    ).choices[0]
    assert final.message.content and not final.message.tool_calls
    assert final.finish_reason in ("stop", "length")


def test_auto_serves_with_the_flag(client):
    """The 135M model rarely calls a tool by itself; "auto" must still answer, content or calls."""
    response = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=60, temperature=0)
    choice = response.choices[0]
    if choice.message.tool_calls:
        assert_valid_calls(choice.message.tool_calls)
        assert choice.finish_reason == "tool_calls"
    else:
        assert choice.message.content and choice.finish_reason in ("stop", "length")


TWO_CALLS = json.dumps(
    {
        "tool_calls": [
            {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}},
            {"name": "get_time", "arguments": {"zone": "CET"}},
        ]
    }
)


@pytest.mark.parametrize("parallel", [True, False])
def test_auto_with_parallel_calls_off_keeps_the_first_call(client, parallel):
    """Under "auto" the model may write several calls; parallel_tool_calls false keeps the first,
    whole and streamed (as vLLM). The output is pinned to two calls by a choice constraint."""
    kwargs = dict(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        parallel_tool_calls=parallel,
        max_tokens=100,
        extra_body={"structured_outputs": {"choice": [TWO_CALLS]}},
    )
    want = ["get_weather", "get_time"] if parallel else ["get_weather"]
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert [c.function.name for c in whole.message.tool_calls] == want
    assert whole.finish_reason == "tool_calls"
    streamed: dict[int, str] = {}
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for call in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            if call.function.name:
                streamed[call.index] = call.function.name
    assert [streamed[i] for i in sorted(streamed)] == want


def test_langchain_bind_tools_and_function_calling(server):
    langchain_openai = pytest.importorskip("langchain_openai")
    import pydantic

    llm = langchain_openai.ChatOpenAI(
        model=MODEL, base_url=f"{server.base_url}/v1", api_key=API_KEY, temperature=0, max_tokens=120, max_retries=0
    )
    message = llm.bind_tools(TOOLS, tool_choice="required").invoke(ASK[0]["content"])
    assert message.tool_calls and message.tool_calls[0]["name"] in SCHEMAS

    class Zone(pydantic.BaseModel):
        zone: str = pydantic.Field(max_length=8)

    result = llm.with_structured_output(Zone, method="function_calling").invoke("Which time zone is Paris in?")
    assert isinstance(result, Zone)


DANGLING = {"type": "object", "properties": {"p": {"$ref": "#/$defs/Missing"}}}
LOOKAHEAD = {"type": "object", "properties": {"a": {"type": "string", "pattern": "(?=a)b"}}}
LOOSE = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["b"]}
BAD = [
    (
        {
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
            "tool_choice": "required",
        },
        "tools[0].function.parameters",
    ),
    (
        {
            "tools": [
                {"type": "function", "function": {"name": "f", "parameters": {"type": "array", "uniqueItems": True}}}
            ]
        },
        "tools[0].function.parameters",
    ),
    (  # a local $ref to nothing, where the calls are forced: refused before compiling
        {
            "tools": [TIME, {"type": "function", "function": {"name": "f", "parameters": DANGLING}}],
            "tool_choice": "required",
        },
        "tools[1].function.parameters",
    ),
    (  # a required name its properties do not define, forced and strict: xgrammar would leave it out
        {
            "tools": [{"type": "function", "function": {"name": "f", "parameters": LOOSE, "strict": True}}],
            "tool_choice": {"type": "function", "function": {"name": "f"}},
        },
        "tools[0].function.parameters",
    ),
    (  # a lookahead the grammar library leaves out when it compiles the forced calls: the strict tool is named
        {
            "tools": [TIME, {"type": "function", "function": {"name": "f", "parameters": LOOKAHEAD, "strict": True}}],
            "tool_choice": "required",
        },
        "tools[1].function.parameters",
    ),
    (  # under "auto" too: a strict tool's calls are held to its schema, all of it
        {"tools": [TIME, {"type": "function", "function": {"name": "f", "parameters": LOOKAHEAD, "strict": True}}]},
        "tools[1].function.parameters",
    ),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "missing"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    (
        {"tools": TOOLS, "tool_choice": {"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": []}}},
        "tool_choice.allowed_tools",
    ),
    (
        {
            "tools": TOOLS,
            "tool_choice": {
                "type": "allowed_tools",
                "allowed_tools": {"mode": "required", "tools": [{"type": "function", "function": {"name": "nope"}}]},
            },
        },
        "tool_choice.allowed_tools.tools[0]",
    ),
    ({"messages": [{"role": "tool", "content": "42"}]}, "messages[0].tool_call_id"),
]


@pytest.mark.parametrize("extra, param", BAD, ids=[f"{i}-{b[1]}" for i, b in enumerate(BAD)])
def test_bad_tool_requests_are_400_naming_the_field(http, extra, param):
    response = http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 8} | extra)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.json()


def test_forced_tools_that_are_not_strict_have_what_the_grammar_cannot_enforce_left_out(http):
    """As vLLM serves them: pydantic-ai forces a call among all of an agent's tools, and one with a
    set[str] argument (`uniqueItems`), a required name its properties do not define or a lookahead
    must not fail them all. The grammar still enforces the rest: the calls parse, their arguments
    are objects of the tools' properties."""
    unique = {"type": "array", "items": {"type": "string"}, "uniqueItems": True}
    tags = {"type": "object", "properties": {"tags": unique}}
    tools = [
        {"type": "function", "function": {"name": "tag", "parameters": {**tags, "required": ["tags"]}}},
        {"type": "function", "function": {"name": "loose", "parameters": LOOSE}},
        {"type": "function", "function": {"name": "ahead", "parameters": LOOKAHEAD}},
        {**TIME, "function": {**TIME["function"], "strict": True}},  # strict beside them: checked alone
    ]
    body = {"messages": ASK, "max_tokens": 60, "tools": tools, "tool_choice": "required", "temperature": 0}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    calls = response.json()["choices"][0]["message"]["tool_calls"]
    assert calls and all(call["function"]["name"] in ("tag", "loose", "ahead", "get_time") for call in calls)
    for call in calls:  # an answer cut by max_tokens leaves its last call's arguments cut
        if response.json()["choices"][0]["finish_reason"] == "tool_calls":
            assert isinstance(json.loads(call["function"]["arguments"]), dict)


@pytest.mark.parametrize("choice", ["auto", "none"])
def test_loosely_written_tool_schemas_are_served_where_nothing_is_compiled(http, choice):
    """As vLLM: a tool is only shown to the model under "auto" and "none" (MCP servers' schemas
    often name a required property they do not define, or refer to nothing)."""
    tools = [
        {"type": "function", "function": {"name": "f", "parameters": LOOSE}},
        {"type": "function", "function": {"name": "g", "parameters": DANGLING}},
    ]
    body = {"messages": ASK, "max_tokens": 4, "tools": tools, "tool_choice": choice}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
