"""Parsing of streamed answers, through httpx's mock transport (no sockets, no timing)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable

import httpx
import pytest

from pagoda.bench.client import StreamResult, Target, list_models, request_body, root_url, stream_request
from pagoda.bench.datasets import Prompt
from pagoda.bench.errors import BenchError

CHAT = Prompt("chat", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})


def sse(*events: object) -> list[bytes]:
    return [(e if isinstance(e, bytes) else f"data: {json.dumps(e)}\n\n".encode()) for e in events]


def delta(content: str | None, finish: str | None = None) -> dict:
    d = {} if content is None else {"content": content}
    return {"choices": [{"index": 0, "delta": d, "finish_reason": finish}]}


def run(handler: Callable[[httpx.Request], httpx.Response], prompt: Prompt = CHAT, **target: object) -> StreamResult:
    async def go() -> StreamResult:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
            return await stream_request(http, Target("http://stub", "m", **target), prompt)  # type: ignore[arg-type]

    return asyncio.run(go())


def streaming(chunks: list[bytes], status: int = 200) -> Callable[[httpx.Request], httpx.Response]:
    async def body() -> AsyncIterator[bytes]:
        for c in chunks:
            yield c

    return lambda request: httpx.Response(status, content=body(), headers={"content-type": "text/event-stream"})


def test_role_only_and_finish_only_chunks_are_not_tokens() -> None:
    chunks = sse(
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
        delta("Hel"),
        b": ping\n\n",
        delta("lo"),
        delta(None, "stop"),
        {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 2}},
        b"data: [DONE]\n\n",
    )
    result = run(streaming(chunks))
    assert result.error is None
    assert result.text == "Hello" and len(result.token_times) == 2
    assert (result.prompt_tokens, result.completion_tokens) == (9, 2)


def test_completions_text_chunks() -> None:
    chunks = sse(
        {"choices": [{"index": 0, "text": "a"}]}, {"choices": [{"index": 0, "text": "b", "finish_reason": "length"}]}
    )
    result = run(streaming(chunks), Prompt("completions", {"prompt": "x"}))
    assert result.error is None and result.text == "ab" and result.completion_tokens is None


@pytest.mark.parametrize(
    "chunks, message",
    [
        (sse(delta("a")), "ended without a finish_reason"),
        (sse(delta(None, "stop"), b"data: [DONE]\n\n"), "carried no generated text"),
        (sse(delta("a"), {"error": {"message": "out of memory"}}), "error in stream: out of memory"),
        ([b"data: {not json\n\n"], "malformed stream chunk"),
    ],
)
def test_broken_streams_are_errors(chunks: list[bytes], message: str) -> None:
    result = run(streaming(chunks))
    assert result.error is not None and message in result.error


def test_http_errors_carry_the_server_message() -> None:
    result = run(lambda request: httpx.Response(400, json={"error": {"message": "max_tokens is too large"}}))
    assert result.error == "HTTP 400: max_tokens is too large"
    result = run(lambda request: httpx.Response(503, text="overloaded"))
    assert result.error == "HTTP 503: overloaded"


def test_connection_failures_are_errors() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused")

    assert run(refuse).error == "ConnectError: connection refused"


def test_the_request_timeout_bounds_a_silent_server() -> None:
    async def silent() -> AsyncIterator[bytes]:
        await asyncio.sleep(30)
        yield b""

    result = run(lambda request: httpx.Response(200, content=silent()), timeout_s=0.2)
    assert result.error == "no complete answer within 0.2 s"


def test_request_body_forces_streaming_and_model_and_keeps_replayed_fields() -> None:
    prompt = Prompt("completions", {"prompt": "x", "max_tokens": 5, "temperature": 0.7, "n": 3, "model": "old"})
    body = request_body(prompt, Target("http://h", "new", ignore_eos=True, extra_body={"top_k": 5}))
    assert body == {
        "prompt": "x",
        "max_tokens": 5,
        "temperature": 0.7,
        "model": "new",
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "top_k": 5,
    }
    assert request_body(Prompt("completions", {"prompt": "x"}), Target("http://h", "m"))["temperature"] == 0.0


def test_the_api_key_is_sent_as_a_bearer_token() -> None:
    seen: list[str | None] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("authorization"))
        return httpx.Response(401, json={"error": {"message": "bad key"}})

    assert run(handler, api_key="k1").error == "HTTP 401: bad key"
    run(handler)
    assert seen == ["Bearer k1", None]


def test_root_url_accepts_v1() -> None:
    assert root_url("http://h:1/v1/") == root_url("http://h:1") == "http://h:1"


def test_list_models_and_unreachable_server() -> None:
    async def go(handler: Callable[[httpx.Request], httpx.Response]) -> list[str] | None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
            return await list_models(http, "http://h", None)

    assert asyncio.run(go(lambda r: httpx.Response(200, json={"data": [{"id": "a"}, {"id": "b"}]}))) == ["a", "b"]
    assert asyncio.run(go(lambda r: httpx.Response(404))) is None

    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused")

    with pytest.raises(BenchError, match="cannot reach http://h"):
        asyncio.run(go(refuse))
    # a refused key or a server still loading: not "lists no model; pass --model"
    wrong_key = httpx.Response(401, json={"error": {"message": "Invalid API key", "type": "invalid_request_error"}})
    with pytest.raises(BenchError, match=r"refuses the API key \(pass --api-key\): 401 Invalid API key"):
        asyncio.run(go(lambda r: wrong_key))
    with pytest.raises(BenchError, match="is not ready yet: 503 The model is still loading"):
        asyncio.run(go(lambda r: httpx.Response(503, json={"error": {"message": "The model is still loading"}})))
