"""/v1/models, /tokenize, /detokenize, /health, /version, /metrics and /reset_prefix_cache."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from pagoda import __version__
from pagoda.entrypoints.openai.metrics import token_buckets
from tests.server.helpers import MODEL, PROMPTS, metric, wait_idle

pytestmark = pytest.mark.slow

# 60+ tokens: several whole KV blocks of 16, so a repeat finds them in the prefix cache
LONG_PROMPT = " ".join(f"Section {i}: the river bends past the old mill." for i in range(8))


def test_models_lists_the_served_model(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].owned_by == "pagoda" and models[0].model_extra["max_model_len"] == 2048
    assert Path(models[0].model_extra["root"]).name == "SmolLM2-135M-Instruct.Q4_1.gguf"  # as vLLM's: the file loaded
    from pagoda.engine.args import DETERMINISTIC_BY_DEFAULT

    assert models[0].model_extra["deterministic"] is DETERMINISTIC_BY_DEFAULT  # fp32 on the CPU
    assert client.models.retrieve(MODEL).model_dump() == models[0].model_dump()  # OpenAI's retrieve
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("no/such-model")
    assert missing.value.code == "model_not_found"
    listed = httpx.get(f"{client.base_url}models/", headers={"Authorization": f"Bearer {client.api_key}"})
    assert [m["id"] for m in listed.json()["data"]] == [MODEL]  # "/v1/models/" is still the list


def test_tokenize_and_detokenize_round_trip(http):
    tokens = http.post("/tokenize", json={"prompt": PROMPTS[3]}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 5 and tokens["max_model_len"] == 2048
    assert http.post("/detokenize", json={"tokens": tokens["tokens"]}).json() == {"prompt": PROMPTS[3]}
    templated = http.post(
        "/tokenize", json={"model": MODEL, "messages": [{"role": "user", "content": PROMPTS[3]}]}
    ).json()
    assert templated["count"] > tokens["count"]  # the chat template adds its markup
    strings = http.post("/tokenize", json={"prompt": " hello world", "return_token_strs": True}).json()
    assert len(strings["token_strs"]) == strings["count"] and "Ġhello" in strings["token_strs"]  # the vocabulary's


def test_tokenize_renders_tools_as_a_chat_request_does(http):
    messages = [{"role": "user", "content": PROMPTS[3]}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    plain = http.post("/tokenize", json={"messages": messages}).json()["count"]
    with_tools = http.post("/tokenize", json={"messages": messages, "tools": tools}).json()["count"]
    chat = http.post(
        "/v1/chat/completions", json={"messages": messages, "tools": tools, "tool_choice": "none", "max_tokens": 1}
    ).json()
    assert with_tools == chat["usage"]["prompt_tokens"] > plain  # the tools are in the prompt
    bad = http.post("/tokenize", json={"messages": messages, "tools": [{"type": "function"}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tools[0]"


def test_health_and_version_need_no_key(server):
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    assert httpx.get(f"{server.base_url}/ping").status_code == httpx.post(f"{server.base_url}/ping").status_code == 200
    assert httpx.get(f"{server.base_url}/version").json() == {"version": __version__}


def test_cross_origin_calls_from_the_allowed_origin_only(server):
    """The main server runs with --allowed-origins '["http://app.example"]' (vLLM's flag): a browser's
    preflight from it is answered before the key check, and its answers, errors too, carry the
    header; another origin's preflight is refused."""
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
    url = f"{server.base_url}/v1/chat/completions"
    allowed = httpx.options(url, headers={"Origin": "http://app.example", **preflight})
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == "http://app.example"
    assert "POST" in allowed.headers["access-control-allow-methods"]
    other = httpx.options(url, headers={"Origin": "http://elsewhere.example", **preflight})
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    unauthorized = httpx.get(f"{server.base_url}/v1/models", headers={"Origin": "http://app.example"})
    assert unauthorized.status_code == 401  # the key is still needed; the browser may read why
    assert unauthorized.headers["access-control-allow-origin"] == "http://app.example"
    answered = httpx.get(f"{server.base_url}/v1/models", headers={"Origin": "http://app.example", **server.headers})
    assert answered.status_code == 200 and answered.headers["access-control-allow-origin"] == "http://app.example"


def test_the_page_links_resolve_under_a_proxys_prefix(server):
    """The console's page links its script and style relatively, so a browser at a proxy's
    /prefix/ (--root-path) finds them there."""
    page = httpx.get(f"{server.base_url}/").text
    assert 'src="console/console.js"' in page and 'href="console/console.css"' in page
    assert httpx.get(f"{server.base_url}/console/console.js").status_code == 200


def test_repeated_prompt_hits_the_prefix_cache_and_metrics_count_it(client, http, server):
    assert http.post("/reset_prefix_cache").status_code == 200
    before = wait_idle(server.base_url)
    first = client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=2, temperature=0)
    second = client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=2, temperature=0)
    prompt_tokens = first.usage.prompt_tokens
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached == (prompt_tokens - 1) // 16 * 16 and cached >= 48
    after = wait_idle(server.base_url)

    def grew(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, False, **labels)

    assert grew("pagoda:prompt_tokens_total") == 2 * prompt_tokens
    assert grew("pagoda:generation_tokens_total") == 4
    assert grew("pagoda:prefix_cache_queries_total") == 2 * prompt_tokens
    assert grew("pagoda:prefix_cache_hits_total") == cached
    assert grew("pagoda:request_success_total", finished_reason="length") == 2
    assert grew("pagoda:prompt_tokens_cached_total") == cached
    for histogram in (
        "time_to_first_token_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "request_time_per_output_token_seconds",
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
        "request_inference_time_seconds",
        "request_prompt_tokens",
        "request_generation_tokens",
        "inter_token_latency_seconds",  # one interval each: two tokens
    ):
        assert grew(f"pagoda:{histogram}_count") == 2, histogram
    assert grew("pagoda:request_prompt_tokens_sum") == 2 * prompt_tokens
    assert grew("pagoda:request_generation_tokens_sum") == 4
    buckets = token_buckets(2048)  # vLLM's 1-2-5 token buckets up to the context
    assert buckets[:4] == (1, 2, 5, 10) and buckets[-1] == 2000
    fits, below = min(b for b in buckets if b >= prompt_tokens), max(b for b in buckets if b < prompt_tokens)
    assert grew("pagoda:request_prompt_tokens_bucket", le=f"{fits:.1f}") == 2
    assert grew("pagoda:request_prompt_tokens_bucket", le=f"{below:.1f}") == 0
    assert metric(after, "pagoda:prefix_cache_blocks") >= cached // 16
    assert metric(after, "pagoda:num_preemptions_total") >= 0
    # vLLM's per-prompt series: the longest sequence's tokens, n, max_tokens; per sequence the prompt
    # tokens computed and the preemptions
    for histogram, total in [
        ("request_max_num_generation_tokens", 4),
        ("request_params_n", 2),
        ("request_params_max_tokens", 4),
        ("request_prefill_kv_computed_tokens", 2 * prompt_tokens - cached),
        ("request_num_preemptions", 0),
    ]:
        assert (grew(f"pagoda:{histogram}_count"), grew(f"pagoda:{histogram}_sum")) == (2, total), histogram
    # each step's prompt tokens computed and tokens sampled (vLLM's iteration_tokens_total)
    assert grew("pagoda:iteration_tokens_total_sum") == 2 * prompt_tokens - cached + 4
    assert grew("pagoda:iteration_tokens_total_count") >= 4  # a prompt's step, a decode's, for each
    assert grew("pagoda:iteration_tokens_total_bucket", le="+Inf") == grew("pagoda:iteration_tokens_total_count")
    # the HTTP series vLLM's /metrics has (prometheus-fastapi-instrumentator's), and the process's
    assert grew("http_requests_total", handler="/v1/completions", method="POST", status="2xx") == 2
    assert metric(after, "process_resident_memory_bytes") > 100e6


def test_time_to_first_token_is_recorded_as_the_first_token_comes(http, server):
    """Not at the sequence's end: a running request's TTFT is on /metrics already (as vLLM's)."""
    count = "pagoda:time_to_first_token_seconds_count"
    before = metric(wait_idle(server.base_url), count)
    body = {"prompt": "Count to fifty:", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as stream:
        lines = stream.iter_lines()
        next(lines)
        assert metric(httpx.get(f"{server.base_url}/metrics").text, count) == before + 1
        for _ in lines:
            pass
    assert metric(wait_idle(server.base_url), count) == before + 1


def test_a_cache_salt_shares_the_prefix_cache_only_within_its_namespace(client, http):
    """vLLM's cache_salt: requests share cached KV only with requests of the same salt (none is one
    namespace too), on every generation endpoint; outputs are the same either way."""
    assert http.post("/reset_prefix_cache").status_code == 200
    messages = [{"role": "user", "content": LONG_PROMPT}]

    def completion(salt: str | None) -> tuple[int, str]:
        extra = {} if salt is None else {"cache_salt": salt}
        out = client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=2, temperature=0, extra_body=extra)
        return out.usage.prompt_tokens_details.cached_tokens, out.choices[0].text

    def chat(salt: str) -> int:
        out = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=1, temperature=0, extra_body={"cache_salt": salt}
        )
        return out.usage.prompt_tokens_details.cached_tokens

    def responses(salt: str) -> int:
        out = client.responses.create(model=MODEL, input=messages, max_output_tokens=1, extra_body={"cache_salt": salt})
        return out.usage.input_tokens_details.cached_tokens

    salted, text = completion("tenant-a")
    assert salted == 0
    assert completion(None)[0] == 0 and completion("tenant-b")[0] == 0  # neither sees tenant-a's blocks
    again, same_text = completion("tenant-a")
    assert again >= 48 and same_text == text
    assert completion(None)[0] == again and completion("tenant-b")[0] == again  # each its own copy now
    assert chat("tenant-c") == 0 and chat("tenant-c") >= 48 and chat("tenant-d") == 0
    assert responses("tenant-e") == 0 and responses("tenant-e") >= 48 and responses("tenant-a") == 0


def test_an_answers_id_is_the_callers_request_id_as_vllm_names_it(client, http):
    """vLLM's rule: "chatcmpl-" or "cmpl-" and the X-Request-Id header, else the body's request_id;
    a response's id is its request_id as it is. Requests in flight under one id all run."""
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    assert http.post("/v1/chat/completions", json={**chat, "request_id": "trace-1"}).json()["id"] == "chatcmpl-trace-1"
    headed = http.post("/v1/chat/completions", json={**chat, "request_id": "trace-1"}, headers={"X-Request-Id": "h-2"})
    assert headed.json()["id"] == "chatcmpl-h-2"
    two_prompts = {"model": MODEL, "prompt": ["Hi", "there"], "max_tokens": 2, "request_id": "trace-3"}
    assert http.post("/v1/completions", json=two_prompts).json()["id"] == "cmpl-trace-3"
    out = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, extra_body={"request_id": "resp-4"})
    assert out.id == "resp-4"
    long = {**chat, "max_tokens": 24, "ignore_eos": True, "request_id": "same"}
    with ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(lambda _: http.post("/v1/chat/completions", json=long), range(3)))
    assert [(a.status_code, a.json()["id"], a.json()["usage"]["completion_tokens"]) for a in answers] == [
        (200, "chatcmpl-same", 24)
    ] * 3


def test_reset_prefix_cache_empties_it_and_refuses_while_busy(client, http, server):
    client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=1)
    assert http.post("/reset_prefix_cache").status_code == 200
    assert metric(wait_idle(server.base_url), "pagoda:prefix_cache_blocks") == 0
    again = client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=1)
    assert again.usage.prompt_tokens_details.cached_tokens == 0

    body = {"prompt": LONG_PROMPT, "max_tokens": 1900, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as response:
        lines = response.iter_lines()  # kept referenced: a dropped iterator closes the connection
        assert next(lines).startswith("data: ")  # the request runs, for longer than the reset waits
        started = time.monotonic()
        refused = http.post("/reset_prefix_cache")
        waited = time.monotonic() - started
    assert refused.status_code == 409 and waited >= 10
    assert refused.json()["error"]["code"] == "requests_running"
    wait_idle(server.base_url)


def test_reset_prefix_cache_waits_for_requests_that_are_finishing(http, server):
    body = {"prompt": LONG_PROMPT, "max_tokens": 24, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")  # running
        reset = http.post("/reset_prefix_cache")
        rest = list(lines)
    assert reset.status_code == 200
    assert "data: [DONE]" in rest  # it ran to the end
    assert metric(wait_idle(server.base_url), "pagoda:prefix_cache_blocks") == 0


def test_sagemakers_invocations_route_serves_chat_and_completions_by_the_body(http, server):
    """vLLM's /invocations: `messages` is a chat completion, `prompt` a completion; anything else,
    or a bad field, a 400; the API key is asked as on /v1 (vLLM leaves the route open)."""
    chat = http.post("/invocations", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"
    text = http.post("/invocations", json={"prompt": "Hi", "max_tokens": 2, "temperature": 0})
    direct = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "temperature": 0})
    assert text.json()["object"] == "text_completion"
    assert text.json()["choices"][0]["text"] == direct.json()["choices"][0]["text"]
    for body, param in [({"input": "Hi"}, None), ({"prompt": "Hi", "n": 0}, "n")]:
        refused = http.post("/invocations", json=body)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param, refused.text
    assert httpx.post(f"{server.base_url}/invocations", json={"prompt": "Hi"}).status_code == 401


def test_load_counts_generation_requests_until_their_answer_ends(http, server):
    """vLLM's GET /load (open, as /metrics): a stream counts from its arrival until its last chunk is
    sent; a refused request does not stay counted."""

    def load() -> int:
        return httpx.get(f"{server.base_url}/load", timeout=10).json()["server_load"]

    before = load()
    assert http.post("/v1/completions", json={"prompt": "Hi", "n": 0}).status_code == 400
    body = {"prompt": "Count to fifty:", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as stream:
        lines = stream.iter_lines()
        first = next(lines)
        assert first.startswith("data: {"), first
        assert load() == before + 1
        for _ in lines:
            pass
    deadline = time.monotonic() + 10
    while load() != before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert load() == before


def test_openapi_names_each_operation_once(server):
    """FastAPI warns on stderr of an operation id given twice (a route of two methods did)."""
    paths = httpx.get(f"{server.base_url}/openapi.json", timeout=10).json()["paths"]
    ids = [op["operationId"] for methods in paths.values() for op in methods.values()]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)
    assert {"get", "post"} <= set(paths["/ping"])
