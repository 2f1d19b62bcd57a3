"""A stub OpenAI-compatible server for the benchmark's tests: it streams with known delays.

    python bench_stub_server.py --port 0 --ttft 0.05 --itl 0.01

prints "listening on PORT" once it accepts connections. Every request streams `tokens` chunks
("tok0 ", "tok1 ", ...): the first `ttft` seconds after the request arrived, the others `itl`
seconds apart. A chat stream opens at once with a role-only chunk and closes with a
finish_reason-only chunk, the usage chunk (usage.prompt_tokens = the words of the prompt or of
all message contents) and [DONE]. Words in the prompt (a completions prompt, or the last
message) override the defaults for that request:
    ttft=S  itl=S  tokens=N  fail (HTTP 500)  cut (the connection drops after the first token)
A request with a `response_format` (json_schema or json_object) is answered with a small document
valid against the schema, in chunks of CHUNK_CHARS characters (cut at max_tokens, finish_reason
"length"); with --invalid-every N, every Nth such request (counted as they arrive) gets instead,
in turn, a JSON string (parses, matches no object schema) or the document without its last
character (does not parse).
/metrics exports prefix-cache figures in Pagoda's, vLLM's or SGLang's names: each request adds
its prompt words to the queries and hit_percent of them to the hits.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import socket
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

DIRECTIVE = re.compile(r"\b(ttft|itl|tokens)=([0-9.]+)")
CHUNK_CHARS = 4


@dataclass
class Counters:
    queries: int = 0
    hits: int = 0
    structured: int = 0  # requests with a response_format so far
    requests: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class Behaviour:
    ttft: float
    itl: float
    tokens: int
    fail: bool
    cut: bool
    pieces: tuple[str, ...] | None = None  # a structured answer's chunks; None: "tok0 ", "tok1 ", ...


def prompt_text(body: dict[str, Any]) -> str:
    if "messages" in body:
        return str(body["messages"][-1].get("content", ""))
    return str(body.get("prompt", ""))


def prompt_words(body: dict[str, Any]) -> int:
    if "messages" in body:
        return sum(len(str(m.get("content", "")).split()) for m in body["messages"])
    return len(str(body.get("prompt", "")).split())


def behaviour(body: dict[str, Any], args: argparse.Namespace, counters: Counters) -> Behaviour:
    text = prompt_text(body)
    found = {name: float(value) for name, value in DIRECTIVE.findall(text)}
    tokens = int(found.get("tokens", body.get("max_tokens") or 16))
    words = text.split()
    plan = Behaviour(found.get("ttft", args.ttft), found.get("itl", args.itl), tokens, "fail" in words, "cut" in words)
    answer = structured_answer(body, args, counters)
    if answer is None:
        return plan
    pieces = tuple(answer[i : i + CHUNK_CHARS] for i in range(0, len(answer), CHUNK_CHARS))
    return replace(plan, tokens=min(len(pieces), body.get("max_tokens") or len(pieces)), pieces=pieces)


def structured_answer(body: dict[str, Any], args: argparse.Namespace, counters: Counters) -> str | None:
    fmt = body.get("response_format") or {}
    if fmt.get("type") not in ("json_schema", "json_object"):
        return None
    schema = fmt.get("json_schema", {}).get("schema", {"type": "object"})
    document = json.dumps(example(schema, schema))
    counters.structured += 1
    if not args.invalid_every or counters.structured % args.invalid_every:
        return document
    wrong = counters.structured // args.invalid_every % 2
    return json.dumps("not the document") if wrong else document[:-1]


def example(schema: dict[str, Any], root: dict[str, Any]) -> Any:
    """The smallest document of the schema shapes the benchmark's tasks use."""
    if "$ref" in schema:
        return example(root["$defs"][schema["$ref"].rsplit("/", 1)[-1]], root)
    if "anyOf" in schema:
        return example(schema["anyOf"][0], root)
    if "const" in schema:
        return schema["const"]
    if "enum" in schema:
        return schema["enum"][0]
    kind = schema.get("type")
    if kind == "object":
        required = schema.get("required", [])
        return {name: example(sub, root) for name, sub in schema.get("properties", {}).items() if name in required}
    if kind == "array":
        return [example(schema["items"], root) for _ in range(schema.get("minItems", 0))]
    if kind in ("integer", "number"):
        return schema.get("minimum", 0)
    if kind == "string":
        return "s" * max(1, schema.get("minLength", 0))
    return {"boolean": True, "null": None}[kind]


def chunk(body: dict[str, Any], chat: bool, **choice: Any) -> bytes:
    if chat:
        payload = {"object": "chat.completion.chunk", "model": body.get("model"), "choices": [{"index": 0, **choice}]}
    else:
        payload = {"object": "text_completion", "model": body.get("model"), "choices": [{"index": 0, **choice}]}
    return f"data: {json.dumps(payload)}\n\n".encode()


async def stream(body: dict[str, Any], chat: bool, plan: Behaviour, args: argparse.Namespace, counters: Counters):
    started = time.perf_counter()
    if chat:
        yield chunk(body, chat, delta={"role": "assistant", "content": ""}, finish_reason=None)
    for i in range(plan.tokens):
        target = started + plan.ttft + i * plan.itl
        await asyncio.sleep(max(0.0, target - time.perf_counter()))
        piece = plan.pieces[i] if plan.pieces else f"tok{i} "
        yield chunk(body, chat, **({"delta": {"content": piece}} if chat else {"text": piece}), finish_reason=None)
        if plan.cut:
            raise ConnectionAbortedError("cut by request")
    done = {"delta": {}} if chat else {"text": ""}
    complete = plan.pieces is not None and plan.tokens == len(plan.pieces)
    yield chunk(body, chat, **done, finish_reason="stop" if complete else "length")
    words = prompt_words(body)
    counters.queries += words
    counters.hits += words * args.hit_percent // 100
    if (body.get("stream_options") or {}).get("include_usage") and not args.no_usage:
        usage = {"prompt_tokens": words, "completion_tokens": plan.tokens, "total_tokens": words + plan.tokens}
        yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode()
    yield b"data: [DONE]\n\n"


def build_app(args: argparse.Namespace) -> Starlette:
    counters = Counters()

    async def generate(request: Request) -> Response:
        body = await request.json()
        counters.requests.append(body)
        plan = behaviour(body, args, counters)
        if plan.fail:
            return JSONResponse({"error": {"message": "injected failure", "type": "server_error"}}, status_code=500)
        chat = request.url.path.endswith("/chat/completions")
        return StreamingResponse(stream(body, chat, plan, args, counters), media_type="text/event-stream")

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": args.model, "object": "model"}]})

    async def metrics(request: Request) -> Response:
        return PlainTextResponse(metrics_text(args.metrics_style, counters))

    async def received(request: Request) -> Response:
        return JSONResponse(counters.requests)

    routes = [
        Route("/v1/chat/completions", generate, methods=["POST"]),
        Route("/v1/completions", generate, methods=["POST"]),
        Route("/v1/models", models),
        Route("/stub/requests", received),
    ]
    if args.metrics_style != "none":
        routes.append(Route("/metrics", metrics))
    return Starlette(routes=routes)


def metrics_text(style: str, counters: Counters) -> str:
    if style == "pagoda":
        return (
            "# HELP pagoda:prefix_cache_queries Prompt tokens looked up.\n# TYPE pagoda:prefix_cache_queries counter\n"
            f'pagoda:prefix_cache_queries_total{{model_name="stub"}} {float(counters.queries)}\n'
            f'pagoda:prefix_cache_queries_created{{model_name="stub"}} 1.7e9\n'
            f'pagoda:prefix_cache_hits_total{{model_name="stub"}} {float(counters.hits)}\n'
        )
    if style == "vllm":
        labels = 'engine="0",model_name="/models/my model {x}"'
        return (
            f"vllm:prefix_cache_queries_total{{{labels}}} {float(counters.queries)}\n"
            f"vllm:prefix_cache_hits_total{{{labels}}} {float(counters.hits)}\n"
        )
    rate = counters.hits / counters.queries if counters.queries else 0.0
    return f'# TYPE sglang:cache_hit_rate gauge\nsglang:cache_hit_rate{{model_name="stub"}} {rate}\n'


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--model", default="stub-model")
    parser.add_argument("--ttft", type=float, default=0.05)
    parser.add_argument("--itl", type=float, default=0.01)
    parser.add_argument("--startup-delay", type=float, default=0.0)
    parser.add_argument("--no-usage", action="store_true")
    parser.add_argument("--metrics-style", choices=("pagoda", "vllm", "sglang", "none"), default="pagoda")
    parser.add_argument("--hit-percent", type=int, default=50)
    parser.add_argument("--invalid-every", type=int, default=0, help="every Nth structured answer is invalid")
    args = parser.parse_args()
    time.sleep(args.startup_delay)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", args.port))
    sock.listen(128)
    print(f"listening on {sock.getsockname()[1]}", flush=True)
    config = uvicorn.Config(build_app(args), log_level="warning", lifespan="off")
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    sys.exit(main())
