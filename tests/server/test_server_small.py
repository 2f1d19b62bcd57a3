"""On the small server (two sequences at a time, a waiting queue of one, prompts in log lines):
503 when the queue is full, --log-prompts, a reasoning parser's usage and thinking budget, forced calls in a
request template's own tool format, and SIGTERM (last: it ends
the server)."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import jsonschema
import pytest

from pagoda.model_files import load_tokenizer
from tests.server.helpers import SMALL_GRACE_S, metric, sse_events

pytestmark = pytest.mark.slow


def wait_for(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def waiting(base_url: str) -> float:
    return metric(httpx.get(f"{base_url}/metrics").text, "pagoda:num_requests_waiting")


def in_thread(work) -> tuple[threading.Thread, dict]:
    result: dict = {}

    def run() -> None:
        try:
            result["value"] = work()
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            result["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


def test_full_queue_is_503_with_retry_after(small_server):
    base = small_server.base_url
    long = {"prompt": "Count slowly:", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with (
        httpx.Client(base_url=base, timeout=120) as http,
        http.stream("POST", "/v1/completions", json=long) as first,
        http.stream("POST", "/v1/completions", json=long) as second,
    ):
        lines = [first.iter_lines(), second.iter_lines()]  # kept referenced: a dropped iterator closes the connection
        for stream in lines:
            next(stream)  # its first token: both run, as many as are allowed
        queued, result = in_thread(
            lambda: httpx.post(f"{base}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=120)
        )
        wait_for(lambda: waiting(base) == 1)
        refused = httpx.post(f"{base}/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
        chat = httpx.post(
            f"{base}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "stream": True},
        )
    for response in (refused, chat):
        assert response.status_code == 503 and response.headers["Retry-After"] == "1"
        assert response.json()["error"]["code"] == "queue_full"
    queued.join(timeout=120)
    assert result["value"].status_code == 200 and result["value"].json()["usage"]["completion_tokens"] == 2


def test_log_prompts_puts_prompt_text_in_the_log_line(small_server):
    response = httpx.post(
        f"{small_server.base_url}/v1/completions", json={"prompt": "ocelot-quince-5521", "max_tokens": 1}
    )
    request_id = response.json()["id"]
    wait_for(lambda: request_id in small_server.log(), 10)
    [line] = [line for line in small_server.log().splitlines() if request_id in line]
    assert "prompt='ocelot-quince-5521'" in line
    long = "capybara-" * 10  # --max-log-len 30: the line shows the prompt's first 30 characters
    request_id = httpx.post(f"{small_server.base_url}/v1/completions", json={"prompt": long, "max_tokens": 1}).json()
    wait_for(lambda: request_id["id"] in small_server.log(), 10)
    [line] = [line for line in small_server.log().splitlines() if request_id["id"] in line]
    assert line.endswith(f"prompt={long[:30]!r}")


def test_a_tool_parser_the_template_cannot_use_is_named_at_startup(small_server, server):
    """The default model's template shows no tools (they go in the system prompt in the generic
    format): a --tool-call-parser would go unused, and the log says so; without one, nothing."""
    assert "--tool-call-parser hermes is not used: the chat template shows no tools" in small_server.log()
    assert "--tool-call-parser" not in server.log()


def test_disable_fastapi_docs_serves_no_api_docs(small_server, server):
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(f"{small_server.base_url}{path}", timeout=10).status_code == 404
        assert httpx.get(f"{server.base_url}{path}", timeout=10).status_code == 200  # served by default


def test_usage_names_reasoning_tokens_with_a_reasoning_parser(small_server, server):
    """--reasoning-parser (qwen3 here): usage has completion_tokens_details.reasoning_tokens, as
    vLLM's with a parser, in whole and streamed chat answers, and Responses counts them in
    output_tokens_details; none here (this model's answers open with no <think>: the counts
    themselves are tests/tools/test_reasoning.py's). Without a parser, no details."""
    base, body = small_server.base_url, {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    whole = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120).json()["usage"]
    assert whole["completion_tokens"] == 4 and whole["completion_tokens_details"] == {"reasoning_tokens": 0}
    streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=streamed, timeout=120) as response:
        last = sse_events(response.iter_lines())[-2]
    assert last["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}
    streamed["stream_options"]["continuous_usage_stats"] = True  # every chunk's usage names them too
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=streamed, timeout=120) as response:
        chunks = sse_events(response.iter_lines())[:-1]
    assert len(chunks) >= 4 and all(c["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0} for c in chunks)
    answer = httpx.post(f"{base}/v1/responses", json={"input": "Hi", "max_output_tokens": 4}, timeout=120).json()
    assert answer["usage"]["output_tokens_details"] == {"reasoning_tokens": 0}
    plain = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, headers=server.headers, timeout=120)
    assert "completion_tokens_details" not in plain.json()["usage"]


def test_a_thinking_budget_ends_the_thinking_with_a_reasoning_parser(small_server, server):
    """vLLM's thinking_token_budget: after that many tokens of thinking the end tag is forced, and the
    answer follows. qwen3's parser reads thinking only where the output opens with <think>; a logit
    bias on its first token makes this model open with it (the choice constraint then forces the
    rest of the tag), and think in "<" until stopped. Without a parser the budget is a 400."""
    base, tokenizer = small_server.base_url, load_tokenizer(None)
    start, end = (tokenizer.encode(tag, add_special_tokens=False) for tag in ("<think>", "</think>"))
    body = {
        "messages": [{"role": "user", "content": "Is the sky blue?"}],
        "max_tokens": 16,
        "temperature": 0,
        "structured_outputs": {"choice": ["yes", "no"]},
        "logit_bias": {str(start[0]): 100},
        "return_token_ids": True,
    }
    bounded = httpx.post(f"{base}/v1/chat/completions", json={**body, "thinking_token_budget": 4}, timeout=120)
    choice = bounded.json()["choices"][0]
    ids = choice["token_ids"]
    assert ids[: len(start)] == start and ids[len(start) + 4 : len(start) + 4 + len(end)] == end, ids
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] in ("yes", "no")
    assert choice["message"]["reasoning"] == tokenizer.decode(ids[len(start) : len(start) + 4]).strip()
    unbounded = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120).json()["choices"][0]
    assert unbounded["finish_reason"] == "length" and not unbounded["message"]["content"]
    assert unbounded["token_ids"][: len(start) + 4] == ids[: len(start) + 4]  # the same thinking, not cut
    for value in (-2, 1.5, "4"):
        refused = httpx.post(f"{base}/v1/chat/completions", json={**body, "thinking_token_budget": value})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "thinking_token_budget"
    completion = {"prompt": "Hi", "max_tokens": 3, "thinking_token_budget": 2}  # taken (this output does not think)
    assert httpx.post(f"{base}/v1/completions", json=completion, timeout=120).status_code == 200
    plain = httpx.post(f"{server.base_url}/v1/completions", json=completion, headers=server.headers, timeout=120)
    assert plain.status_code == 400 and "--reasoning-parser" in plain.json()["error"]["message"]
    assert plain.json()["error"]["param"] == "thinking_token_budget"


def test_include_reasoning_false_sends_no_per_token_data_with_a_reasoning_parser(small_server, server):
    """vLLM's rule: with a reasoning parser and include_reasoning false, no logprobs or token ids (they
    would show the reasoning left out), whole or streamed; the content is the same. Without a parser
    the flag changes nothing."""
    base = small_server.base_url
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0, "logprobs": True}
    body["return_token_ids"] = True
    shown = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120).json()["choices"][0]
    hidden = httpx.post(f"{base}/v1/chat/completions", json={**body, "include_reasoning": False}, timeout=120).json()
    choice = hidden["choices"][0]
    assert shown["logprobs"]["content"] and len(shown["token_ids"]) == 4
    assert choice["logprobs"] is None and choice["token_ids"] is None and hidden["prompt_token_ids"]
    assert choice["message"]["content"] == shown["message"]["content"]
    streamed = {**body, "include_reasoning": False, "stream": True}
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=streamed, timeout=120) as response:
        chunks = [c["choices"][0] for c in sse_events(response.iter_lines())[:-1]]
    assert all(c["logprobs"] is None and c.get("token_ids") is None for c in chunks)
    assert "".join(c["delta"].get("content") or "" for c in chunks) == shown["message"]["content"]
    plain = httpx.post(
        f"{server.base_url}/v1/chat/completions",
        json={**body, "include_reasoning": False},
        headers=server.headers,
        timeout=120,
    ).json()["choices"][0]
    assert plain["logprobs"]["content"] and len(plain["token_ids"]) == 4
    # Responses passes include_reasoning on, and reasoning.effort as reasoning_effort
    asked = {"input": "Hi", "max_output_tokens": 4, "include": ["message.output_text.logprobs"], "top_logprobs": 1}
    asked["reasoning"] = {"effort": "none"}
    for include_reasoning, shown in ((True, True), (False, False)):
        answer = httpx.post(f"{base}/v1/responses", json={**asked, "include_reasoning": include_reasoning}, timeout=120)
        [part] = [part for item in answer.json()["output"] if item["type"] == "message" for part in item["content"]]
        assert bool(part["logprobs"]) is shown, answer.text


ROLE_LINES = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"


def test_a_requests_own_chat_template_with_trust_request_chat_template(small_server, server):
    """vLLM's --trust-request-chat-template: a chat request's chat_template (and /tokenize's) is what
    renders it; one that does not parse is a 400 naming it, and one reaching outside transformers'
    sandbox is refused; the server goes on serving."""
    base, tokenizer = small_server.base_url, load_tokenizer(None)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    expected = tokenizer.encode("[system] Be brief.\n[user] Hi\n", add_special_tokens=False)
    tokens = httpx.post(f"{base}/tokenize", json={"messages": messages, "chat_template": ROLE_LINES}, timeout=60)
    assert tokens.json()["tokens"] == expected, tokens.text
    chat = {"messages": messages, "max_tokens": 1, "chat_template": ROLE_LINES}
    answer = httpx.post(f"{base}/v1/chat/completions", json=chat, timeout=60)
    assert answer.json()["usage"]["prompt_tokens"] == len(expected), answer.text
    # one that loops over a message's content gets its parts (--chat-template-content-format auto)
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    looping = "{% for m in messages %}{% for part in m.content %}<{{ part.text }}>{% endfor %}{% endfor %}"
    tokens = httpx.post(f"{base}/tokenize", json={"messages": parts, "chat_template": looping}, timeout=60)
    assert tokens.json()["tokens"] == tokenizer.encode("<a><b>", add_special_tokens=False), tokens.text
    for template in ("{% for m in messages %}", "{{ ''.__class__.__mro__[1].__subclasses__() }}"):
        refused = httpx.post(f"{base}/v1/chat/completions", json={**chat, "chat_template": template}, timeout=60)
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"] == "chat_template"
    # errors the template's own code raises on the messages (vLLM: a 400), on one kept-alive connection
    with httpx.Client(base_url=base, timeout=60) as client:
        recursive = "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}"
        for template in ("{{ messages[0]['content'] + 1 }}", "{{ 1 // 0 }}", "{{ range(10**9)|list }}", recursive):
            for path, body in (("/v1/chat/completions", chat), ("/tokenize", {"messages": messages})):
                refused = client.post(path, json={**body, "chat_template": template})
                assert refused.status_code == 400 and refused.json()["error"]["param"] == "messages", refused.text
        assert client.post("/v1/chat/completions", json={**chat, "chat_template": None}).is_success


def test_tool_choice_none_leaves_the_tools_out_with_exclude_tools_when_tool_choice_none(small_server, server):
    """vLLM's --exclude-tools-when-tool-choice-none: tool_choice "none" renders no tools (the main
    server, without the flag, shows them: the default model's template takes them as system text)."""
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    tool = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}

    def prompt_tokens(served, **fields) -> int:
        body = {"messages": messages, "max_tokens": 1, **fields}
        answer = httpx.post(f"{served.base_url}/v1/chat/completions", json=body, headers=served.headers, timeout=60)
        return answer.json()["usage"]["prompt_tokens"]

    assert prompt_tokens(small_server, tools=[tool], tool_choice="none") == prompt_tokens(small_server)
    assert prompt_tokens(server, tools=[tool], tool_choice="none") > prompt_tokens(server)


def test_forced_calls_in_the_models_own_format(small_server):
    """A template that shows tools in Hermes' format (Qwen's; a request's own template on the small
    server, which also runs the hermes and qwen3 parsers): "required" and a named function are held
    to that format, which the model was taught, as vLLM 0.32 holds them, not to the generic one.
    Only the hermes parser reads such calls, and they validate; streamed, the same calls."""
    from tests.server.test_chat_render import QWEN3_STYLE_TEMPLATE
    from tests.server.test_server_tools import ASK, SCHEMAS, TOOLS

    body = {
        "messages": ASK,
        "tools": TOOLS,
        "temperature": 0,
        "max_tokens": 100,
        "chat_template": QWEN3_STYLE_TEMPLATE,
        "chat_template_kwargs": {"enable_thinking": False},
    }
    url = f"{small_server.base_url}/v1/chat/completions"
    named = {"type": "function", "function": {"name": "get_time"}}
    for choice, allowed, finish in (("required", tuple(SCHEMAS), "tool_calls"), (named, ("get_time",), "stop")):
        answer = httpx.post(url, json=body | {"tool_choice": choice}, timeout=120).json()["choices"][0]
        calls = answer["message"]["tool_calls"]
        assert calls and answer["finish_reason"] == finish, answer
        for call in calls:
            assert call["function"]["name"] in allowed
            jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])
    streamed: dict[int, list[str]] = {}
    with httpx.stream("POST", url, json=body | {"tool_choice": named, "stream": True}, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    for call in choice["delta"].get("tool_calls") or []:
                        parts = streamed.setdefault(call["index"], ["", ""])
                        parts[0] += call["function"].get("name") or ""
                        parts[1] += call["function"].get("arguments") or ""
    assert list(streamed.values()) == [[c["function"]["name"], c["function"]["arguments"]] for c in calls]


def test_sigterm_finishes_in_flight_aborts_after_grace_and_exits_0(small_server):
    """At SIGTERM two streams run: one of 2000 tokens, which cannot finish within the grace and is
    aborted, and one of 12 tokens that has just sent its first, which finishes; a non-streamed
    request of 2000 tokens waits. What still runs at the grace's end gets an error: an error event
    and [DONE] on the stream, a 503 body for the other; no traceback; exit code 0."""
    base = small_server.base_url
    first_tokens = {"endless": threading.Event(), "short": threading.Event()}

    def stream(name: str, prompt: str, max_tokens: int) -> tuple[list, float]:
        body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as response:
            lines = []
            for line in response.iter_lines():
                lines.append(line)
                first_tokens[name].set()
            return sse_events(lines), time.monotonic()

    endless, endless_result = in_thread(lambda: stream("endless", "kestrel-endless-9034", 2000))
    assert first_tokens["endless"].wait(timeout=60)
    short, short_result = in_thread(lambda: stream("short", "Finish me", 12))
    assert first_tokens["short"].wait(timeout=60)
    body = {"prompt": "kestrel-whole-5517", "max_tokens": 2000, "ignore_eos": True}
    whole, whole_result = in_thread(lambda: httpx.post(f"{base}/v1/completions", json=body, timeout=120))
    wait_for(lambda: waiting(base) == 1)
    small_server.process.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    short.join(timeout=SMALL_GRACE_S + 30)
    assert "value" in short_result, short_result.get("error")
    events, finished = short_result["value"]
    assert finished > signalled  # it was in flight
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{base}/health", timeout=2)  # no longer accepting
    assert small_server.process.wait(timeout=SMALL_GRACE_S + 60) == 0
    endless.join(timeout=10)
    events, ended = endless_result["value"]
    assert events[-1] == "[DONE]" and "shutting down" in events[-2]["error"]["message"], events[-3:]
    assert ended - signalled >= SMALL_GRACE_S
    whole.join(timeout=10)
    response = whole_result["value"]
    assert response.status_code == 503 and "--shutdown-timeout" in response.json()["error"]["message"]
    log = small_server.log()
    [line] = [line for line in log.splitlines() if "kestrel-endless-9034" in line]
    assert "finish_reason=abort" in line
    assert "Traceback" not in log and "aborted 2 request(s) still running" in log
