"""One streamed request to an OpenAI-compatible server, timed chunk by chunk.

Only chunks that carry generated text count as tokens: a chat server's opening chunk (the
role, no content), a closing chunk with only finish_reason, keep-alive comments and the usage
chunk do not, so TTFT cannot be shortened by a server that announces the role before prefill.
As in vLLM's client, a request ends at its last token chunk, so E2E = TTFT + the sum of ITLs.
A chunk carrying a tool-call delta counts as a token chunk too; the deltas are assembled into
whole calls (OpenAI's shape: `delta.tool_calls[i]` with its `index`, first the call's `id`,
`type` and `function.name`, then fragments of `function.arguments`, concatenated as OpenAI's
own client does). Every request is bounded by the target's timeout, and every failure becomes a
message in the result rather than an exception. `whole_request` sends a request without
streaming, to compare its tool calls with the streamed ones.

HTTP goes through aiohttp, as in vLLM's client: its C parser and asyncio protocol read a stream's
chunks at 0.6-0.75x the CPU time per chunk that httpx took (its stack of httpcore, anyio
and h11 is crossed for every network read), which a server streaming thousands of chunks a
second turns into throughput (benchmarks/bench_client_overhead.py). A stream's bytes are split
into lines here, on SSE's line ends only (CR, LF, CRLF), and each network read is timed once:
the chunks it carried arrived together.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from pagoda.bench.datasets import Prompt
from pagoda.bench.errors import BenchError, NotAnswering
from pagoda.bench.tool_calls import Call

PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
ERROR_TEXT_LIMIT = 300
MODELS_TIMEOUT_S = 10.0  # GET /v1/models
NO_REDIRECTS = {"allow_redirects": False}  # a redirect is the server's answer, as httpx left it
# compact UTF-8, NaN refused, as httpx wrote a body
_JSON_BODY = functools.partial(json.dumps, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


@dataclass(frozen=True)
class Target:
    base_url: str  # scheme://host:port, without /v1
    model: str
    api_key: str | None = None
    timeout_s: float = 600.0
    temperature: float = 0.0
    ignore_eos: bool = False
    extra_body: dict[str, Any] = field(default_factory=dict)  # read-only by convention


@dataclass(frozen=True)
class StreamResult:
    sent_at: float  # time.perf_counter() clock
    token_times: tuple[float, ...]  # arrivals of the chunks that carried generated text
    text: str  # everything generated: content, reasoning, tool-call names and arguments
    prompt_tokens: int | None  # from the server's usage, when it sent one
    completion_tokens: int | None
    error: str | None
    answer: str = ""  # `text` without the reasoning deltas: what a structured output is graded on
    finish_reason: str | None = None
    tool_calls: tuple[Call, ...] = ()  # assembled from the deltas, in index order


@dataclass(frozen=True)
class WholeResult:
    """A request answered without streaming: its tool calls, or why there is no answer."""

    tool_calls: tuple[Call, ...]
    error: str | None = None


def root_url(base_url: str) -> str:
    """The server root: users write both http://host:port and http://host:port/v1."""
    return base_url.rstrip("/").removesuffix("/v1")


def request_body(prompt: Prompt, target: Target, stream: bool = True) -> dict[str, Any]:
    """Replayed fields win over the run's defaults; the target decides model and streaming."""
    forced: dict[str, Any] = {"model": target.model, "stream": stream}
    if stream:
        forced["stream_options"] = {"include_usage": True}
    if target.ignore_eos:
        forced["ignore_eos"] = True
    body = {"temperature": target.temperature, **prompt.body, **target.extra_body, **forced}
    body.pop("n", None)  # one choice per request: the timing is per stream
    if not stream:
        body.pop("stream_options", None)
    return body


def headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def make_client(
    max_connections: int, timeout_s: float, extra_headers: Sequence[tuple[str, str]] = ()
) -> aiohttp.ClientSession:
    """One session for every request of a run; create it inside the event loop. `max_connections`
    is the most requests the run has in flight (the runner's bound), so no request waits for a
    connection. `extra_headers` go with every request (--header).

    Every request opens its own connection (force_close), as the httpx client before did: a
    server whose sockets lack TCP_NODELAY (uvicorn on a socket it was handed, vLLM's among them)
    holds a response's first chunks until the client acknowledges its headers, and on a kept-alive
    connection the client's ACK is delayed by up to 40 ms, so the first chunks would arrive
    bunched, late, and the ITLs would read 0. A fresh connection acknowledges at once."""
    # trust_env=False: a proxy from the environment must not sit between client and server.
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=max_connections, limit_per_host=0, force_close=True),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=min(10.0, timeout_s), sock_read=timeout_s),
        headers=list(extra_headers),
        trust_env=False,
        json_serialize=_JSON_BODY,
    )


class _Stream:
    """Accumulates one stream's chunks; `feed` answers True when the stream is over."""

    def __init__(self, sent_at: float) -> None:
        self.sent_at = sent_at
        self.times: list[float] = []
        self.pieces: list[str] = []
        self.answer: list[str] = []
        self.finish_reason: str | None = None
        self.calls: dict[int, _CallParts] = {}
        self.usage: dict[str, Any] = {}
        self.finished = False
        self.error: str | None = None

    async def read(self, body: aiohttp.StreamReader) -> None:
        """Feed the stream's lines as they arrive, until [DONE], an error or the end of the body."""
        rest = b""
        async for data in body.iter_any():
            now = time.perf_counter()
            if rest:
                data = rest + data
            lines = data.splitlines()
            rest = b"" if data.endswith((b"\n", b"\r")) else lines.pop()
            for line in lines:
                if line and self.feed(line.decode("utf-8", errors="replace"), now):
                    return
        if rest:
            self.feed(rest.decode("utf-8", errors="replace"), time.perf_counter())

    def feed(self, line: str, now: float) -> bool:
        """One line of the stream, read at `now`; True when the stream is over."""
        if not line.startswith("data:"):
            return False  # blank separators, ": keep-alive" comments, "event:" lines
        data = line.removeprefix("data:").strip()
        if data == "[DONE]":
            self.finished = True
            return True
        try:
            chunk = json.loads(data)
        except json.JSONDecodeError:
            return self.fail(f"malformed stream chunk: {data[:ERROR_TEXT_LIMIT]!r}")
        if not isinstance(chunk, dict):
            return self.fail(f"malformed stream chunk: {data[:ERROR_TEXT_LIMIT]!r}")
        if "error" in chunk:
            return self.fail(f"error in stream: {_message(chunk)}")
        self._take_choice(chunk.get("choices") or [], now)
        self.usage = chunk.get("usage") or self.usage
        return False

    def _take_choice(self, choices: list[Any], now: float) -> None:
        choice = next((c for c in choices if isinstance(c, dict) and c.get("index", 0) == 0), None)
        if choice is None:
            return
        delta = choice.get("delta") or {}
        answer = choice.get("text") or delta.get("content")
        piece = (answer or delta.get("reasoning_content") or delta.get("reasoning") or "") + self._take_calls(delta)
        if piece:
            self.times.append(now)
            self.pieces.append(piece)
        if answer:
            self.answer.append(answer)
        if choice.get("finish_reason"):
            self.finished, self.finish_reason = True, str(choice["finish_reason"])

    def _take_calls(self, delta: dict[str, Any]) -> str:
        """Add a delta's tool-call fragments to their calls; returns the text they carried."""
        calls = delta.get("tool_calls")
        carried = []
        for position, entry in enumerate(calls if isinstance(calls, list) else ()):
            if not isinstance(entry, dict):
                continue
            index = entry.get("index", position)
            parts = self.calls.setdefault(index if isinstance(index, int) else position, _CallParts())
            function = entry.get("function") if isinstance(entry.get("function"), dict) else {}
            for fragment, into in ((function.get("name"), parts.name), (function.get("arguments"), parts.arguments)):
                if isinstance(fragment, str) and fragment:
                    into.append(fragment)
                    carried.append(fragment)
        return "".join(carried)

    def fail(self, message: str) -> bool:
        self.error = self.error or message
        return True

    def result(self) -> StreamResult:
        error = self.error
        if error is None and not self.finished:
            error = "the stream ended without a finish_reason or [DONE]"
        if error is None and not self.times:
            error = "the stream carried no generated text"
        return StreamResult(
            sent_at=self.sent_at,
            token_times=tuple(self.times),
            text="".join(self.pieces),
            prompt_tokens=_count(self.usage.get("prompt_tokens")),
            completion_tokens=_count(self.usage.get("completion_tokens")),
            error=error,
            answer="".join(self.answer),
            finish_reason=self.finish_reason,
            tool_calls=tuple(self.calls[index].call() for index in sorted(self.calls)),
        )


@dataclass
class _CallParts:
    name: list[str] = field(default_factory=list)
    arguments: list[str] = field(default_factory=list)

    def call(self) -> Call:
        return Call("".join(self.name), "".join(self.arguments))


async def stream_request(http: aiohttp.ClientSession, target: Target, prompt: Prompt) -> StreamResult:
    stream = _Stream(time.perf_counter())
    try:
        async with asyncio.timeout(target.timeout_s):
            url = target.base_url + PATHS[prompt.endpoint]
            async with http.post(
                url, json=request_body(prompt, target), headers=headers(target.api_key), **NO_REDIRECTS
            ) as response:
                if response.status >= 400:
                    stream.fail(f"HTTP {response.status}: {_error_text(await response.read(), response.reason)}")
                else:
                    await stream.read(response.content)
    except aiohttp.ClientError as exc:  # before TimeoutError: aiohttp's connect and read timeouts are both
        stream.fail(_failure(exc))
    except TimeoutError:
        stream.fail(f"no complete answer within {target.timeout_s:g} s")
    return stream.result()


async def whole_request(http: aiohttp.ClientSession, target: Target, prompt: Prompt) -> WholeResult:
    """The request sent without streaming; only its tool calls are kept."""
    url = target.base_url + PATHS[prompt.endpoint]
    try:
        async with asyncio.timeout(target.timeout_s):
            body = request_body(prompt, target, stream=False)
            async with http.post(url, json=body, headers=headers(target.api_key), **NO_REDIRECTS) as response:
                status, reason, raw = response.status, response.reason, await response.read()
    except aiohttp.ClientError as exc:
        return WholeResult((), _failure(exc))
    except TimeoutError:
        return WholeResult((), f"no answer within {target.timeout_s:g} s")
    if status >= 400:
        return WholeResult((), f"HTTP {status}: {_error_text(raw, reason)}")
    try:
        message = json.loads(raw)["choices"][0]["message"]
        return WholeResult(tuple(_whole_call(entry) for entry in message.get("tool_calls") or ()))
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        return WholeResult((), f"malformed answer: {_text(raw)[:ERROR_TEXT_LIMIT]!r}")


def _whole_call(entry: dict[str, Any]) -> Call:
    function = entry["function"]
    arguments = function.get("arguments")
    if not isinstance(arguments, str):  # not OpenAI's shape: kept as JSON text, so it still compares
        arguments = json.dumps(arguments)
    return Call(str(function["name"]), arguments)


async def list_models(http: aiohttp.ClientSession, base_url: str, api_key: str | None) -> list[str] | None:
    """The served model ids; None when the server has no /v1/models. Raises BenchError when
    nothing answers at all, or the server refuses the key (401, 403) or is not ready (503): passing
    --model would not help then."""
    try:
        status, raw = await _get(http, f"{base_url}/v1/models", headers(api_key), MODELS_TIMEOUT_S)
    except (aiohttp.ClientError, TimeoutError) as exc:
        silent = f"no answer within {MODELS_TIMEOUT_S:g} s" if isinstance(exc, TimeoutError) else "no detail"
        detail = str(exc) or silent
        raise NotAnswering(
            f"cannot reach {base_url}: {type(exc).__name__}: {detail}. Is the server running there?"
        ) from None
    if status in (401, 403, 503):
        reason = "refuses the API key (pass --api-key)" if status != 503 else "is not ready yet"
        try:
            message = _message(json.loads(raw))
        except ValueError:
            message = _text(raw)
        error = NotAnswering if status == 503 else BenchError
        raise error(f"{base_url}/v1/models: the server {reason}: {status} {message[:300]}")
    if status != 200:
        return None
    try:
        return [str(m["id"]) for m in json.loads(raw).get("data", [])]
    except (ValueError, TypeError, KeyError, AttributeError):
        return None


async def reset_prefix_cache(http: aiohttp.ClientSession, base_url: str, api_key: str | None) -> bool:
    """POST /reset_prefix_cache (Pagoda's, and vLLM's in its dev mode). False when the server has
    no such route (404); raises BenchError for any other refusal."""
    url = f"{base_url}/reset_prefix_cache"
    try:
        async with http.post(
            url, headers=headers(api_key), timeout=aiohttp.ClientTimeout(total=30.0), **NO_REDIRECTS
        ) as response:
            status, reason, raw = response.status, response.reason, await response.read()
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise BenchError(f"POST {url}: {_failure(exc)}") from None
    if status == 404:
        return False
    if status >= 400:
        raise BenchError(f"POST {url} answered {status}: {_error_text(raw, reason)}")
    return True


async def get_text(http: aiohttp.ClientSession, url: str, timeout_s: float) -> tuple[int, str]:
    """GET `url`: its status and its body as text. Raises aiohttp.ClientError or TimeoutError."""
    status, raw = await _get(http, url, {}, timeout_s)
    return status, _text(raw)


async def _get(http: aiohttp.ClientSession, url: str, extra: dict[str, str], timeout_s: float) -> tuple[int, bytes]:
    async with http.get(url, headers=extra, timeout=aiohttp.ClientTimeout(total=timeout_s), **NO_REDIRECTS) as response:
        return response.status, await response.read()


def _failure(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".rstrip(": ")


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", errors="replace")


def _error_text(raw: bytes, reason: str | None) -> str:
    text = _text(raw[:4096])
    try:
        return _message(json.loads(text))[:ERROR_TEXT_LIMIT]
    except (json.JSONDecodeError, TypeError):
        return text.strip()[:ERROR_TEXT_LIMIT] or (reason or "")


def _message(payload: Any) -> str:
    """The message of an OpenAI-style error ({"error": {"message"}}), FastAPI's {"detail"}, or the payload."""
    if isinstance(payload, dict):
        error = payload.get("error", payload.get("detail", payload))
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        return str(error)
    return str(payload)


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and value >= 0 else None
