"""Every refusal over raw HTTP: OpenAI's error body, the right status, the offending param named;
and the engine keeps serving afterwards."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.server.helpers import MODEL

pytestmark = pytest.mark.slow

CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
COMPLETION = {"prompt": "Hi", "max_tokens": 2}


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


@pytest.mark.parametrize("path", ["/v1/models", "/v1/completions", "/v1/chat/completions", "/reset_prefix_cache"])
@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "test-key"}])
def test_missing_or_wrong_key_is_401(server, path, headers):
    method = "GET" if path == "/v1/models" else "POST"
    response = httpx.request(method, server.base_url + path, headers=headers, json=CHAT | COMPLETION)
    assert error_of(response, 401)["code"] == "invalid_api_key"


def test_unknown_model_is_404(http):
    for path, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
        error = error_of(http.post(path, json={**body, "model": "gpt-4"}), 404)
        assert error["param"] == "model" and "gpt-4" in error["message"] and MODEL in error["message"]
        assert http.post(path, json={**body, "model": ""}).status_code == 200  # empty: the served model, as vLLM


def test_vllm_bounds_on_truncation_and_top_logprobs(http):
    """truncate_prompt_tokens past the context is refused (vLLM's 400); a chat's top_logprobs 0
    without logprobs is harmless (some clients always send it), any other still needs logprobs."""
    too_long = {**COMPLETION, "truncate_prompt_tokens": 10**6}
    assert error_of(http.post("/v1/completions", json=too_long), 400)["param"] == "truncate_prompt_tokens"
    assert http.post("/v1/chat/completions", json={**CHAT, "top_logprobs": 0}).status_code == 200
    assert error_of(http.post("/v1/chat/completions", json={**CHAT, "top_logprobs": 2}), 400)["param"] == (
        "top_logprobs"
    )


def test_unknown_route_is_an_openai_404(http):
    assert error_of(http.get("/v1/nothing"), 404)["type"] == "invalid_request_error"
    unserved = error_of(http.post("/v1/embeddings", json={"model": MODEL, "input": "hi"}), 404)
    assert unserved["code"] == "unsupported_endpoint" and "/v1/chat/completions" in unserved["message"]
    assert "--runner pooling" in unserved["message"]


@pytest.mark.parametrize(
    "field, value",
    [
        ("tool_choice", "auto"),  # without tools
        ("functions", [{"name": "f"}]),
        ("function_call", "auto"),
        ("audio", {"voice": "alloy", "format": "wav"}),
        ("modalities", ["text", "audio"]),
        # vLLM's, which this server cannot honour
        ("logprob_token_ids", [42]),
        ("repetition_detection", {"max_pattern_size": 8}),
    ],
)
def test_unsupported_chat_fields_are_400(http, field, value):
    error = error_of(http.post("/v1/chat/completions", json={**CHAT, field: value}), 400)
    assert error["param"] == field and field in error["message"]


def test_a_requests_own_chat_template_is_400_without_trust_request_chat_template(http):
    """As vLLM: the server renders with its own template unless started with the flag (on the small
    server, test_server_small.py)."""
    template = {"chat_template": "{{ messages[0].content }}"}
    for path in ("/v1/chat/completions", "/tokenize"):
        body = {**CHAT, **template} if path != "/tokenize" else {"messages": CHAT["messages"], **template}
        error = error_of(http.post(path, json=body), 400)
        assert error["param"] == "chat_template" and "--trust-request-chat-template" in error["message"], path


@pytest.mark.parametrize(
    "field, value",
    [("suffix", "tail"), ("prompt_embeds", "AAAA")],
)
def test_unsupported_completion_fields_are_400(http, field, value):
    assert error_of(http.post("/v1/completions", json={**COMPLETION, field: value}), 400)["param"] == field


@pytest.mark.parametrize(
    "extra",
    [{"best_of": 1, "n": 2}, {"best_of": 3, "stream": True}, {"best_of": 3, "use_beam_search": True}, {"best_of": 0}],
)
def test_best_of_below_n_streamed_or_beam_searched_is_400(http, extra):
    """OpenAI's rules: best_of at least n, and its samples are not streamed."""
    assert error_of(http.post("/v1/completions", json={**COMPLETION, **extra}), 400)["param"] == "best_of"


@pytest.mark.parametrize(
    "path, extra, param",
    [
        ("/v1/completions", {"stream": True}, "stream"),
        ("/v1/completions", {"echo": True}, "echo"),
        ("/v1/completions", {"prompt_logprobs": 1}, "prompt_logprobs"),
        ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
        ("/v1/chat/completions", {"structured_outputs": {"choice": ["a", "b"]}}, "structured_outputs"),
        ("/v1/completions", {"n": 11}, "n"),
    ],
)
def test_what_beam_search_cannot_serve_is_400(http, path, extra, param):
    body = {**(COMPLETION if path == "/v1/completions" else CHAT), "use_beam_search": True, "n": 2, **extra}
    error = error_of(http.post(path, json=body), 400)
    assert error["param"] == param and "use_beam_search" in error["message"]


@pytest.mark.parametrize("salt", ["", "a/b", "tenant@a", "back\\slash", "nul\0", "x" * 129, 7])
def test_a_cache_salt_vllm_refuses_is_400(http, salt):
    """vLLM's rule: a non-empty string of at most 128 characters without '@', '/', '\\' or NUL."""
    for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)):
        assert error_of(http.post(path, json={**body, "cache_salt": salt}), 400)["param"] == "cache_salt", path
    responses = {"input": "hi", "max_output_tokens": 1, "cache_salt": salt}
    assert error_of(http.post("/v1/responses", json=responses), 400)["param"] == "cache_salt"


@pytest.mark.parametrize("request_id", ["", "two\nlines", 7])
def test_a_request_id_that_cannot_name_an_answer_is_400(http, request_id):
    for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)):
        assert error_of(http.post(path, json={**body, "request_id": request_id}), 400)["param"] == "request_id", path
    responses = {"input": "hi", "max_output_tokens": 1, "request_id": request_id}
    assert error_of(http.post("/v1/responses", json=responses), 400)["param"] == "request_id"


def test_an_x_request_id_with_a_control_character_is_400(http):
    """It would reach log lines, as a body's request_id would."""
    refused = http.post("/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "a\tb"})
    assert error_of(refused, 400)["param"] == "X-Request-Id"


def test_harmless_values_of_refused_fields_pass(http):
    ok = {
        "response_format": {"type": "text"},
        "tool_choice": "none",
        "modalities": ["text"],
        "unknown_field": 1,
        "use_beam_search": False,
        "logprob_token_ids": [],
        "thinking_token_budget": -1,  # vLLM's: no budget
        "repetition_detection": {"max_pattern_size": 0},  # vLLM's: off
    }
    assert http.post("/v1/chat/completions", json={**CHAT, **ok}).status_code == 200
    assert http.post("/v1/completions", json={**COMPLETION, "best_of": 1}).status_code == 200
    assert http.post("/v1/completions", json={**COMPLETION, "repetition_detection": {}}).status_code == 200
    # vLLM's clients send prompt_embeds without a prompt: the 400 names it, not the missing prompt
    embeds = {key: value for key, value in COMPLETION.items() if key != "prompt"}
    assert error_of(http.post("/v1/completions", json={**embeds, "prompt_embeds": "AAAA"}), 400)["param"] == (
        "prompt_embeds"
    )
    assert error_of(http.post("/v1/completions", json=embeds), 400)["param"] == "prompt"


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {**COMPLETION, "temperature": "hot"}, "temperature"),
        ("/v1/completions", {**COMPLETION, "temperature": -1}, "temperature"),
        ("/v1/completions", {**COMPLETION, "temperature": 3}, "temperature"),
        ("/v1/completions", {**COMPLETION, "stop": ["\n", ""]}, "stop"),
        ("/v1/completions", {**COMPLETION, "n": 0}, "n"),
        ("/v1/completions", {**COMPLETION, "top_p": 0}, "top_p"),
        ("/v1/completions", {**COMPLETION, "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {**COMPLETION, "logprobs": 50}, "logprobs"),
        ("/v1/completions", {**COMPLETION, "presence_penalty": 3}, "presence_penalty"),
        ("/v1/completions", {**COMPLETION, "logit_bias": {"99999999": 1}}, "logit_bias"),
        ("/v1/completions", {**COMPLETION, "logit_bias": {"5": 500}}, "logit_bias"),
        ("/v1/completions", {**COMPLETION, "stop_token_ids": [-1]}, "stop_token_ids"),
        ("/v1/completions", {**COMPLETION, "seed": 2**70}, "seed"),
        ("/v1/completions", {**COMPLETION, "top_k": 2**70}, "top_k"),
        ("/v1/completions", {**COMPLETION, "temperature": float("inf")}, "temperature"),
        ("/v1/completions", {**COMPLETION, "repetition_penalty": float("nan")}, "repetition_penalty"),
        ("/v1/completions", {**COMPLETION, "stream_options": {"include_usage": True}}, "stream_options"),
        ("/v1/completions", {"prompt": [1, 2, 10**9], "max_tokens": 2}, "prompt"),
        ("/v1/completions", {"prompt": [], "max_tokens": 2}, "prompt"),
        ("/v1/completions", {"prompt": "", "max_tokens": 2}, "prompt"),
        ("/v1/completions", {"max_tokens": 2}, "prompt"),
        ("/v1/chat/completions", {"max_tokens": 2}, "messages"),
        ("/v1/chat/completions", {**CHAT, "messages": []}, "messages"),
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": 7, "content": "x"}]}, "messages[0].role"),
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        (
            "/v1/chat/completions",
            {
                **CHAT,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "hi"},
                            {"type": "image_url", "image_url": {"url": "http://x"}},
                        ],
                    }
                ],
            },
            "messages[0].content[1].type",
        ),
        ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/chat/completions", {**CHAT, "max_completion_tokens": -3}, "max_completion_tokens"),
        ("/detokenize", {"tokens": [10**9]}, "tokens"),
        ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt"),
        ("/tokenize", {"messages": []}, "messages"),
        ("/v1/chat/completions", {**CHAT, "messages": None}, "messages"),  # a required field's null
        ("/v1/chat/completions", {**CHAT, "response_format": "json_object"}, "response_format"),  # not an object
        # lone surrogates (JSON's unpaired \ud800 escapes): no tokenizer or grammar takes them
        # the param is the place itself
        (
            "/v1/chat/completions",
            {**CHAT, "messages": [{"role": "user", "content": "hi \ud800"}]},
            "messages[0].content",
        ),
        ("/v1/completions", {**COMPLETION, "prompt": "\udfff"}, "prompt"),
        ("/tokenize", {"prompt": "a\ud800b"}, "prompt"),
        (
            "/v1/chat/completions",
            {**CHAT, "tools": [{"type": "function", "function": {"name": "f", "description": "\ud800"}}]},
            "tools[0].function.description",
        ),
        (
            "/v1/chat/completions",
            {**CHAT, "structured_outputs": {"choice": ["a", "\ud800"]}},
            "structured_outputs.choice[1]",
        ),
        (
            "/v1/chat/completions",
            {
                **CHAT,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"enum": ["\ud800"]}},
                },
            },
            "response_format.json_schema.schema.enum[0]",
        ),
    ],
)
def test_invalid_parameters_are_400_naming_the_param(http, path, body, param):
    content = json.dumps(body)  # Python's json writes Infinity and NaN, as some clients do
    error = error_of(http.post(path, content=content, headers={"Content-Type": "application/json"}), 400)
    assert error["param"] == param and error["type"] == "invalid_request_error"
    if "surrogate" in error["message"]:
        assert error["message"].startswith(f"{param} holds a lone UTF-16 surrogate"), error["message"]


def test_null_takes_the_default(http):
    """OpenAI's nullable fields: an explicit null is the default, not a 400."""
    nulls = ("n", "stream", "logprobs", "presence_penalty", "min_p", "parallel_tool_calls", "ignore_eos")
    chat = http.post("/v1/chat/completions", json={**CHAT, **dict.fromkeys(nulls)})
    assert chat.status_code == 200 and len(chat.json()["choices"]) == 1, chat.text
    assert chat.json()["choices"][0]["logprobs"] is None
    completion = http.post("/v1/completions", json={**COMPLETION, **dict.fromkeys(("n", "echo", "stream"))})
    assert completion.status_code == 200 and completion.json()["choices"][0]["text"] != "Hi", completion.text
    unbounded = http.post("/v1/completions", json={**COMPLETION, "max_tokens": None, "ignore_eos": True})
    assert unbounded.json()["usage"]["completion_tokens"] == 16, unbounded.text  # completions' default


def test_a_body_not_sent_as_json_is_400_saying_so(http):
    """vLLM 0.32 answers 400 (its validation error) where 415 might be expected."""
    for headers in ({"Content-Type": "application/x-www-form-urlencoded"}, {}):
        response = http.post("/v1/completions", content=b'{"prompt": "Hi", "max_tokens": 2}', headers=headers)
        assert "Content-Type: application/json" in error_of(response, 400)["message"]
    vendor = {"Content-Type": "application/vnd.api+json"}  # JSON too, as FastAPI reads it: its own 400
    bad = http.post("/v1/completions", content=b'{"prompt": "Hi", "max_tokens": "x"}', headers=vendor)
    assert error_of(bad, 400)["param"] == "max_tokens"


def test_malformed_json_is_400(http):
    response = http.post("/v1/completions", content=b"{not json", headers={"Content-Type": "application/json"})
    assert "JSON" in error_of(response, 400)["message"]
    empty = http.post("/v1/chat/completions", content=b"", headers={"Content-Type": "application/json"})
    assert "body is empty" in error_of(empty, 400)["message"]


def test_a_prompt_with_no_room_left_is_400_with_the_numbers(http):
    whole = [{"role": "user", "content": "word " * 2100}]  # the prompt alone fills the context
    error = error_of(http.post("/v1/chat/completions", json={"messages": whole}), 400)
    assert error["param"] == "messages" and "maximum context length is 2048 tokens" in error["message"]
    error = error_of(http.post("/v1/completions", json={"prompt": [42] * 2048, "max_tokens": 1}), 400)
    assert error["param"] == "prompt" and "you requested 2048 tokens in the prompt" in error["message"]
    for path, body, param in (
        ("/v1/completions", {**COMPLETION, "max_tokens": 100_000}, "max_tokens"),
        ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 2049}, "max_completion_tokens"),
    ):
        error = error_of(http.post(path, json=body), 400)  # the limit alone is past the context: it is named
        assert error["param"] == param and "maximum context length of 2048 tokens" in error["message"]


def test_a_prompt_plus_max_tokens_past_the_context_ends_at_the_context(http):
    """vLLM's rule: max_tokens shortened to the room left, the answer cut there ("length"); the
    default max_tokens of a completion likewise; truncate_prompt_tokens -1 keeps one token of room."""
    answer = http.post("/v1/completions", json={"prompt": [42] * 2040, "max_tokens": 100, "ignore_eos": True})
    assert answer.status_code == 200, answer.text
    usage, choice = answer.json()["usage"], answer.json()["choices"][0]
    assert (usage["prompt_tokens"], usage["completion_tokens"], choice["finish_reason"]) == (2040, 8, "length")
    default = http.post("/v1/completions", json={"prompt": [42] * 2040, "ignore_eos": True}).json()["usage"]
    assert default["completion_tokens"] == 8  # 16 by default, 8 left
    chat = http.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "word " * 2000}], "max_tokens": 100, "ignore_eos": True},
    ).json()
    assert chat["usage"]["total_tokens"] == 2048 and chat["choices"][0]["finish_reason"] == "length"
    cut = http.post("/v1/completions", json={"prompt": [42] * 3000, "truncate_prompt_tokens": -1, "max_tokens": 4})
    usage = cut.json()["usage"]
    assert cut.status_code == 200 and (usage["prompt_tokens"], usage["completion_tokens"]) == (2047, 1), cut.text
    unmet = http.post("/v1/completions", json={"prompt": [42] * 2040, "max_tokens": 100, "min_tokens": 9})
    assert error_of(unmet, 400)["param"] == "min_tokens"  # 8 tokens of room: min_tokens cannot hold


def test_the_engine_still_serves_after_bad_input(http, server):
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    assert http.post("/v1/completions", json=COMPLETION).json()["usage"]["completion_tokens"] == 2


def test_priority_is_taken_and_checked(http):
    """vLLM's priority field: taken on every generation endpoint (it orders requests only under
    --scheduling-policy priority), refused by name when it is not an integer."""
    assert http.post("/v1/chat/completions", json={**CHAT, "priority": -3}).status_code == 200
    assert http.post("/v1/responses", json={"input": "hi", "max_output_tokens": 1, "priority": 2}).status_code == 200
    assert error_of(http.post("/v1/completions", json={**COMPLETION, "priority": "high"}), 400)["param"] == "priority"
