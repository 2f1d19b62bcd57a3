"""Parsing of streamed answers, against real HTTP servers on loopback (aiohttp's, in the test's
event loop): chunks as they come over the wire, split across reads or together in one."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web
from bench_helpers import Handler, closed_port, http_server, sse_handler

from pagoda.bench import client
from pagoda.bench.client import (
    StreamResult,
    Target,
    list_models,
    make_client,
    request_body,
    root_url,
    stream_request,
)
from pagoda.bench.datasets import Prompt
from pagoda.bench.errors import BenchError

CHAT = Prompt("chat", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})


def sse(*events: object) -> list[bytes]:
    return [(e if isinstance(e, bytes) else f"data: {json.dumps(e)}\n\n".encode()) for e in events]


def delta(content: str | None, finish: str | None = None) -> dict:
    d = {} if content is None else {"content": content}
    return {"choices": [{"index": 0, "delta": d, "finish_reason": finish}]}


async def send(url: str, prompt: Prompt = CHAT, **target: object) -> StreamResult:
    async with make_client(4, 600.0) as http:
        return await stream_request(http, Target(url, "m", **target), prompt)  # type: ignore[arg-type]


def run(handler: Handler, prompt: Prompt = CHAT, **target: object) -> StreamResult:
    async def go() -> StreamResult:
        async with http_server(handler) as url:
            return await send(url, prompt, **target)

    return asyncio.run(go())


def streaming(chunks: list[bytes], status: int = 200, pause_s: float = 0.0) -> Handler:
    return sse_handler(chunks, status, pause_s)


def answer(status: int, **response: object) -> Handler:
    async def handle(request: web.Request) -> web.StreamResponse:
        if "json" in response:
            return web.json_response(response["json"], status=status)
        return web.Response(status=status, text=str(response.get("text", "")))

    return handle


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
    result = run(answer(400, json={"error": {"message": "max_tokens is too large"}}))
    assert result.error == "HTTP 400: max_tokens is too large"
    assert run(answer(503, text="overloaded")).error == "HTTP 503: overloaded"
    assert run(answer(502)).error == "HTTP 502: Bad Gateway"  # no body: the reason phrase


def test_connection_failures_are_errors() -> None:
    port = closed_port()
    error = asyncio.run(send(f"http://127.0.0.1:{port}")).error
    assert error is not None and error.startswith(f"ClientConnectorError: Cannot connect to host 127.0.0.1:{port}")


def test_a_dropped_connection_is_an_error() -> None:
    async def drop(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(sse(delta("a"))[0])
        assert request.transport is not None
        request.transport.close()  # mid-body: the chunked body never ends
        return response

    error = run(drop).error
    assert error is not None and error.startswith("ClientPayloadError: Response payload is not completed")


def test_the_request_timeout_bounds_a_silent_server() -> None:
    async def silent(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await asyncio.sleep(30)
        return response

    result = run(silent, timeout_s=0.2)
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

    async def handler(request: web.Request) -> web.StreamResponse:
        seen.append(request.headers.get("authorization"))
        return web.json_response({"error": {"message": "bad key"}}, status=401)

    assert run(handler, api_key="k1").error == "HTTP 401: bad key"
    run(handler)
    assert seen == ["Bearer k1", None]


def test_root_url_accepts_v1() -> None:
    assert root_url("http://h:1/v1/") == root_url("http://h:1") == "http://h:1"


def test_list_models_and_unreachable_server() -> None:
    async def go(handler: Handler | None) -> list[str] | None:
        async with make_client(1, 5.0) as http:
            if handler is None:
                return await list_models(http, f"http://127.0.0.1:{closed_port()}", None)
            async with http_server(handler) as url:
                return await list_models(http, url, None)

    assert asyncio.run(go(answer(200, json={"data": [{"id": "a"}, {"id": "b"}]}))) == ["a", "b"]
    assert asyncio.run(go(answer(404))) is None
    assert asyncio.run(go(answer(200, text="not json"))) is None
    with pytest.raises(BenchError, match="cannot reach http://127.0.0.1:[0-9]+: ClientConnectorError: Cannot connect"):
        asyncio.run(go(None))
    # a refused key or a server still loading: not "lists no model; pass --model"
    wrong_key = {"error": {"message": "Invalid API key", "type": "invalid_request_error"}}
    with pytest.raises(BenchError, match=r"refuses the API key \(pass --api-key\): 401 Invalid API key"):
        asyncio.run(go(answer(401, json=wrong_key)))
    with pytest.raises(BenchError, match="is not ready yet: 503 The model is still loading"):
        asyncio.run(go(answer(503, json={"error": {"message": "The model is still loading"}})))


def test_a_server_that_does_not_answer_the_model_list_in_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(client, "MODELS_TIMEOUT_S", 0.2)

    async def slow(request: web.Request) -> web.StreamResponse:
        await asyncio.sleep(30)
        return web.json_response({"data": []})

    async def go() -> None:
        async with make_client(1, 5.0) as http, http_server(slow) as url:
            await list_models(http, url, None)

    with pytest.raises(BenchError, match="cannot reach http://127.0.0.1:[0-9]+: TimeoutError: no answer within 0.2 s"):
        asyncio.run(go())


def test_lines_split_across_reads_and_every_sse_line_end() -> None:
    """A line cut anywhere (inside a UTF-8 character, between CR and LF) is put back together;
    CR, LF and CRLF all end lines; the last line needs no line end."""
    event = json.dumps(delta("h\u00e9llo"), ensure_ascii=False).encode()
    pieces = [
        b"data: " + event[:30],
        event[30 : event.index(b"\xc3") + 1],  # the first byte of the two of "\u00e9"
        event[event.index(b"\xc3") + 1 :] + b"\r",
        b"\n\r\n: keep-alive\r\rdata: " + json.dumps(delta(" there", "stop")).encode() + b"\r\n\r\n",
        b"data: [DO",
        b"NE]",
    ]
    result = run(streaming(pieces, pause_s=0.02))
    assert result.error is None and result.text == "h\u00e9llo there" and result.finish_reason == "stop"
    assert len(result.token_times) == 2


def test_unicode_line_separators_inside_a_chunk_are_not_line_ends() -> None:
    """Only CR and LF end an event stream's lines: U+2028, NEL, form feed and the like are text."""
    text = "a\u2028b\u2029c\x85d\x0ce\x1cf\x0bg"
    chunks = [f"data: {json.dumps(delta(text, 'stop'), ensure_ascii=False)}\n\n".encode(), b"data: [DONE]\n\n"]
    result = run(streaming(chunks))
    assert result.error is None and result.text == text


def test_a_chunk_longer_than_a_read_buffer() -> None:
    text = "x" * 300_000
    result = run(streaming(sse(delta(text), delta(None, "stop"), b"data: [DONE]\n\n")))
    assert result.error is None and result.text == text and len(result.token_times) == 1


def test_chunks_are_timed_as_they_arrive() -> None:
    """Chunks read together arrive together; a chunk read later carries its later time."""
    together = b"".join(sse(delta("a"), delta("b")))
    result = run(streaming([together, *sse(delta("c", "stop"))], pause_s=0.1))
    first, second, third = result.token_times
    assert second == first and third - second >= 0.1
    assert result.text == "abc" and first > result.sent_at


def test_every_request_has_a_connection_of_its_own(start_stub) -> None:
    """Against a server without TCP_NODELAY (the stub: uvicorn on a socket made with proto 0), a
    kept-alive connection's delayed ACKs would hold each answer's first chunks until they came
    together, 40 ms late; on a connection of its own each chunk comes when it is sent."""
    stub = start_stub("--ttft", "0.02", "--itl", "0.01")
    prompt = Prompt("completions", {"prompt": "x", "max_tokens": 4})

    async def go() -> list[StreamResult]:
        async with make_client(1, 5.0) as http:
            return [await stream_request(http, Target(stub.base_url, "stub-model"), prompt) for _ in range(4)]

    results = asyncio.run(go())
    for result in results:
        assert result.error is None and len(result.token_times) == 4
        gaps = [later - earlier for earlier, later in zip(result.token_times, result.token_times[1:])]
        assert all(gap > 0.005 for gap in gaps), gaps
