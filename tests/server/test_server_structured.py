"""Structured outputs through a real server: OpenAI's response_format, vLLM's structured_outputs
and guided_* spellings, the official client's `parse`, LangChain, streaming, and bad input."""

from __future__ import annotations

import concurrent.futures
import json
import re
import uuid

import httpx
import jsonschema
import pydantic
import pytest

from tests.server.helpers import API_KEY, MODEL

pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 16},
        "population": {"type": "integer", "minimum": 0, "maximum": 100000000},
    },
    "required": ["city", "population"],
}
ASK = [{"role": "user", "content": "Give one city and its population as JSON."}]


class City(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=16)
    population: int = pydantic.Field(ge=0, le=100_000_000)


TAGGED = {
    "type": "structural_tag",
    "format": {
        "type": "tag",
        "begin": "<city>",
        "content": {"type": "json_schema", "json_schema": SCHEMA},
        "end": "</city>",
    },
}
LEGACY = {"begin": "<city>", "schema": SCHEMA, "end": "</city>"}


def chat(http: httpx.Client, **body) -> httpx.Response:
    return http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 80, "temperature": 0} | body)


def text_of(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    return choice["message"]["content"] if "message" in choice else choice["text"]


def test_response_format_json_schema_and_json_object(http):
    schema_format = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
    jsonschema.validate(json.loads(text_of(chat(http, response_format=schema_format))), SCHEMA)
    not_strict = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": False}}
    jsonschema.validate(json.loads(text_of(chat(http, response_format=not_strict))), SCHEMA)
    assert isinstance(json.loads(text_of(chat(http, response_format={"type": "json_object"}))), dict)


def test_completions_take_response_format_too(http):
    body = {"prompt": "A city as JSON:", "max_tokens": 80, "temperature": 0}
    response_format = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}
    response = http.post("/v1/completions", json=body | {"response_format": response_format})
    jsonschema.validate(json.loads(text_of(response)), SCHEMA)


@pytest.mark.parametrize(
    "body, check",
    [
        ({"structured_outputs": {"regex": "[A-Z][a-z]{2,8}"}}, lambda t: re.fullmatch("[A-Z][a-z]{2,8}", t)),
        ({"structured_outputs": {"choice": ["Paris", "Rome"]}}, lambda t: t in ("Paris", "Rome")),
        (
            {"structured_outputs": {"grammar": 'root ::= "city: " [a-z]+ "."'}},
            lambda t: re.fullmatch("city: [a-z]+[.]", t),
        ),
        ({"structured_outputs": {"json": SCHEMA}}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
        ({"structured_outputs": {"json_object": True}}, lambda t: isinstance(json.loads(t), dict)),
        ({"guided_json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
        ({"guided_regex": "[0-9]{4}"}, lambda t: re.fullmatch("[0-9]{4}", t)),
        ({"guided_choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
        ({"guided_grammar": 'root ::= "a" | "b"'}, lambda t: t in ("a", "b")),
        (  # xgrammar's structural tag, vLLM's structural_tag: here the whole output is one tagged object
            {"structured_outputs": {"structural_tag": json.dumps(TAGGED)}},
            lambda t: (
                jsonschema.validate(json.loads(t.removeprefix("<city>").removesuffix("</city>")), SCHEMA) is None
                and t.startswith("<city>")
            ),
        ),
        (
            {"response_format": TAGGED},
            lambda t: (
                jsonschema.validate(json.loads(t.removeprefix("<city>").removesuffix("</city>")), SCHEMA) is None
                and t.startswith("<city>")
            ),
        ),
    ],
    ids=lambda value: next(iter(value)) if isinstance(value, dict) else "",
)
def test_vllm_spellings(http, body, check):
    text = text_of(chat(http, **body))
    assert check(text), text


def test_a_structural_tag_in_its_older_form_leaves_text_free_and_holds_what_a_tag_opens(http):
    """vLLM's older structural_tag response_format: text, and where the model writes a trigger, the
    tagged object (tests/tools/test_tags.py holds the grammar to it token by token)."""
    tagged = {"type": "structural_tag", "structures": [LEGACY], "triggers": ["<city>"]}
    response = chat(http, response_format=tagged, max_tokens=40)
    assert response.status_code == 200, response.text
    text = response.json()["choices"][0]["message"]["content"]
    for part in text.split("<city>")[1:]:
        if "</city>" in part:
            jsonschema.validate(json.loads(part.split("</city>")[0]), SCHEMA)


def test_streaming_equals_non_streaming_and_n_gives_valid_outputs(client):
    response_format = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}
    kwargs = dict(model=MODEL, messages=ASK, max_tokens=80, temperature=1.0, seed=11, response_format=response_format)
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    streamed = "".join(
        c.choices[0].delta.content or "" for c in client.chat.completions.create(**kwargs, stream=True) if c.choices
    )
    assert streamed == whole
    jsonschema.validate(json.loads(whole), SCHEMA)
    many = client.chat.completions.create(**(kwargs | {"n": 3})).choices
    assert len(many) == 3
    for choice in many:
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_openai_client_parse_with_a_pydantic_model(client):
    completion = client.chat.completions.parse(
        model=MODEL, messages=ASK, response_format=City, max_tokens=80, temperature=0
    )
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, City) and parsed.city


@pytest.mark.parametrize("method", ["json_schema", "json_mode"])
def test_langchain_with_structured_output(server, method):
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(
        model=MODEL, base_url=f"{server.base_url}/v1", api_key=API_KEY, temperature=0, max_tokens=80, max_retries=0
    )
    structured = llm.with_structured_output(City if method == "json_schema" else SCHEMA, method=method)
    result = structured.invoke("Give one city and its population as JSON with keys city and population.")
    if method == "json_schema":
        assert isinstance(result, City)
    else:
        assert isinstance(result, dict)


UNIQUE = {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}}}
BAD = [
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
        "response_format",
        "invalid JSON schema",
    ),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
        "response_format.json_schema",
        "name",
    ),
    ({"response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
    ({"response_format": {"type": "structural_tag"}}, "response_format", '"format", or "structures"'),
    (  # the library's own reason, without the head of its failed C++ check
        {"response_format": {"type": "structural_tag", "format": {"type": "nonsense"}}},
        "response_format",
        "RuntimeError: Invalid structural tag error: Format type not recognized: nonsense",
    ),
    ({"structured_outputs": {"structural_tag": "{not json"}}, "structured_outputs", "not valid JSON"),
    ({"structured_outputs": {"regex": "([a-z]"}}, "structured_outputs", "parenthesis is not closed"),
    ({"structured_outputs": {"grammar": "root ::= undefined_rule"}}, "structured_outputs", "is not defined"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs", "choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "at most one"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex", "at most one"),
    (  # only where strict: else left unenforced, as vLLM (test_a_schema_keyword_..._left_out)
        {"response_format": {"type": "json_schema", "json_schema": {"name": "u", "schema": UNIQUE, "strict": True}}},
        "response_format",
        "uniqueItems",
    ),
    ({"guided_json": {"$ref": "https://example.com/schema.json"}}, "guided_json", "another document"),
    ({"guided_json": {"properties": {"p": {"$ref": "#/$defs/Missing"}}}}, "guided_json", "points to nothing"),
    ({"guided_regex": "\\p{L}+"}, "guided_regex", "not supported"),
]


def test_a_schema_keyword_the_grammar_cannot_enforce_is_left_out_unless_strict(http, server):
    """As vLLM serves it (LangChain's and instructor's json_schema modes send pydantic's `uniqueItems`
    without `strict`): the rest of the schema holds, and the server logs what it left out as it
    compiles the schema (a title of this run's own: no grammar cache on disk has it)."""
    schema = {**UNIQUE, "required": ["a"], "additionalProperties": False, "title": uuid.uuid4().hex}
    spec = {"name": "u", "schema": schema}
    for body in ({"response_format": {"type": "json_schema", "json_schema": spec}}, {"guided_json": spec["schema"]}):
        response = chat(http, max_tokens=40, **body)
        assert response.status_code == 200, response.text
        answer = response.json()["choices"][0]
        if answer["finish_reason"] == "stop":
            assert isinstance(json.loads(answer["message"]["content"])["a"], list)
    assert "not strict, leaving unenforced: the JSON schema uses `uniqueItems` at properties/a" in server.log()


@pytest.mark.parametrize("body, param, reason", BAD, ids=[f"{i}-{b[1]}" for i, b in enumerate(BAD)])
def test_bad_constraints_are_400_naming_the_field(http, body, param, reason):
    response = chat(http, **body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and reason in error["message"], error


def test_bad_constraints_amid_good_streams_leave_them_unaffected(http, client):
    kwargs = dict(model=MODEL, messages=ASK, max_tokens=40, temperature=0)
    alone = client.chat.completions.create(**kwargs).choices[0].message.content

    def good() -> str:
        stream = client.chat.completions.create(**kwargs, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        goods = [pool.submit(good) for _ in range(3)]
        bads = [pool.submit(chat, http, **body) for body, _, _ in BAD]
        assert all(f.result().status_code == 400 for f in bads)
        assert [f.result() for f in goods] == [alone] * 3


def test_logprobs_and_stop_strings_work_with_a_constraint(client):
    response_format = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}
    kwargs = dict(model=MODEL, messages=ASK, max_tokens=80, temperature=0, response_format=response_format)
    whole = client.chat.completions.create(**kwargs, logprobs=True, top_logprobs=2).choices[0]
    document = whole.message.content
    jsonschema.validate(json.loads(document), SCHEMA)
    entries = whole.logprobs.content
    text = "".join(e.token for e in entries)
    assert text.startswith(document) and text[len(document) :] == "<|im_end|>"  # the end token closes it
    assert all(e.logprob <= 0 and len(e.top_logprobs) == 2 for e in entries)
    # A stop string inside the document ends it there, as without a constraint.
    cut = client.chat.completions.create(**kwargs, stop=['"population"']).choices[0]
    assert cut.finish_reason == "stop" and document.startswith(cut.message.content)
    assert '"population"' not in cut.message.content
