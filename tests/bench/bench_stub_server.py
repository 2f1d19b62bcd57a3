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
A chat request with `tools` (and tool_choice other than "none") is answered with one call: of
the named function, else of the first tool, its arguments the smallest document of the tool's
parameters. Streamed, the call comes as OpenAI's deltas (index, id, type and name first, then
the arguments in chunks of CHUNK_CHARS characters) and ends with finish_reason "tool_calls";
with "stream": false the same call comes in message.tool_calls. Streamed tool requests are
numbered as they arrive, and a request without streaming that repeats one (same messages and
tools) takes its number, so both get the same answer unless an option says otherwise:
--invalid-tools-every N: every Nth streamed tool request, and its non-streamed twin, is answered
in turn with arguments that match no tool's schema, a tool that was not offered, no call (text
content), or arguments without their last character (not JSON);
--tools-differ-every N: every Nth one's non-streamed twin writes its arguments without spaces.
Any request with "stream": false gets a whole answer (after the stream's total delay).
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
INVALID_CALLS = ("bad JSON", "schema", "unknown tool", "no calls")  # taken in turn, from the numbers' ratio


@dataclass
class Counters:
    queries: int = 0
    hits: int = 0
    structured: int = 0  # requests with a response_format so far
    tool_requests: int = 0  # streamed requests with tools so far
    tool_numbers: dict[str, int] = field(default_factory=dict)  # a tool request's key -> its number
    requests: list[dict[str, Any]] = field(default_factory=list)
    resets: int = 0  # POST /reset_prefix_cache so far (with --reset-route)


@dataclass(frozen=True)
class ToolAnswer:
    calls: tuple[tuple[str, str], ...]  # (name, arguments JSON text)
    content: str = ""


@dataclass(frozen=True)
class Behaviour:
    ttft: float
    itl: float
    tokens: int
    fail: bool
    cut: bool
    pieces: tuple[str, ...] | None = None  # a structured answer's chunks; None: "tok0 ", "tok1 ", ...
    tools: ToolAnswer | None = None  # a tool request's answer
    deltas: tuple[dict[str, Any], ...] | None = None  # a tool answer's chunks


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
    tools = tool_answer(body, args, counters)
    if tools is not None:
        deltas = tuple(tool_deltas(tools))
        return replace(plan, tokens=min(len(deltas), body.get("max_tokens") or len(deltas)), tools=tools, deltas=deltas)
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


def tool_answer(body: dict[str, Any], args: argparse.Namespace, counters: Counters) -> ToolAnswer | None:
    functions = [tool["function"] for tool in body.get("tools") or ()]
    choice = body.get("tool_choice")
    if not functions or choice == "none":
        return None
    key = json.dumps([body.get("messages"), body.get("tools")], sort_keys=True)
    if body.get("stream"):
        counters.tool_requests += 1
        counters.tool_numbers[key] = counters.tool_requests
    number = counters.tool_numbers.get(key, 0)
    named = choice["function"]["name"] if isinstance(choice, dict) else None
    function = next((f for f in functions if f["name"] == named), functions[0])
    parameters = function.get("parameters") or {"type": "object"}
    document = example(parameters, parameters)
    compact = not body.get("stream") and _every(number, args.tools_differ_every)
    arguments = json.dumps(document, separators=(",", ":")) if compact else json.dumps(document)
    if not _every(number, args.invalid_tools_every):
        return ToolAnswer(((function["name"], arguments),))
    wrong = INVALID_CALLS[number // args.invalid_tools_every % len(INVALID_CALLS)]
    if wrong == "no calls":
        return ToolAnswer((), "I would rather not call a tool.")
    if wrong == "unknown tool":
        return ToolAnswer((("no_such_tool", arguments),))
    return ToolAnswer(((function["name"], arguments[:-1] if wrong == "bad JSON" else '{"no_such_argument": 1}'),))


def _every(number: int, n: int) -> bool:
    return bool(n and number and number % n == 0)


def tool_deltas(answer: ToolAnswer) -> list[dict[str, Any]]:
    """A tool answer as OpenAI's stream deltas."""
    deltas: list[dict[str, Any]] = [
        {"content": answer.content[i : i + CHUNK_CHARS]} for i in range(0, len(answer.content), CHUNK_CHARS)
    ]
    for index, (name, arguments) in enumerate(answer.calls):
        head = {"index": index, "id": f"call_{index}", "type": "function", "function": {"name": name, "arguments": ""}}
        deltas.append({"tool_calls": [head]})
        deltas += [
            {"tool_calls": [{"index": index, "function": {"arguments": arguments[i : i + CHUNK_CHARS]}}]}
            for i in range(0, len(arguments), CHUNK_CHARS)
        ]
    return deltas


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
        delta = plan.deltas[i] if plan.deltas else {"content": piece}
        yield chunk(body, chat, **({"delta": delta} if chat else {"text": piece}), finish_reason=None)
        if plan.cut:
            raise ConnectionAbortedError("cut by request")
    done = {"delta": {}} if chat else {"text": ""}
    yield chunk(body, chat, **done, finish_reason=finish_reason(plan))
    words = prompt_words(body)
    counters.queries += words
    counters.hits += words * args.hit_percent // 100
    if (body.get("stream_options") or {}).get("include_usage") and not args.no_usage:
        usage = {"prompt_tokens": words, "completion_tokens": plan.tokens, "total_tokens": words + plan.tokens}
        yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode()
    yield b"data: [DONE]\n\n"


def finish_reason(plan: Behaviour) -> str:
    chunks = plan.deltas or plan.pieces
    if chunks is None or plan.tokens < len(chunks):
        return "length"
    return "tool_calls" if plan.tools and plan.tools.calls else "stop"


async def whole(body: dict[str, Any], chat: bool, plan: Behaviour) -> dict[str, Any]:
    """The answer without streaming, after the time the stream would have taken."""
    await asyncio.sleep(plan.ttft + max(0, plan.tokens - 1) * plan.itl)
    text = "".join(plan.pieces[: plan.tokens] if plan.pieces else (f"tok{i} " for i in range(plan.tokens)))
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason(plan)}
    if plan.tools is not None:
        calls = [
            {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": arguments}}
            for i, (name, arguments) in enumerate(plan.tools.calls)
        ]
        choice["message"] = {"role": "assistant", "content": plan.tools.content or None, "tool_calls": calls}
    elif chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    usage = {"prompt_tokens": prompt_words(body), "completion_tokens": plan.tokens}
    return {"object": "chat.completion" if chat else "text_completion", "choices": [choice], "usage": usage}


def build_app(args: argparse.Namespace) -> Starlette:
    counters = Counters()

    async def generate(request: Request) -> Response:
        body = await request.json()
        counters.requests.append(body)
        plan = behaviour(body, args, counters)
        if plan.fail:
            return JSONResponse({"error": {"message": "injected failure", "type": "server_error"}}, status_code=500)
        chat = request.url.path.endswith("/chat/completions")
        if body.get("stream") is False:
            return JSONResponse(await whole(body, chat, plan))
        return StreamingResponse(stream(body, chat, plan, args, counters), media_type="text/event-stream")

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": args.model, "object": "model"}]})

    async def metrics(request: Request) -> Response:
        return PlainTextResponse(metrics_text(args.metrics_style, counters))

    async def received(request: Request) -> Response:
        return JSONResponse(counters.requests)

    async def reset(request: Request) -> Response:
        counters.resets += 1
        return JSONResponse({"resets": counters.resets})

    routes = [
        Route("/v1/chat/completions", generate, methods=["POST"]),
        Route("/v1/completions", generate, methods=["POST"]),
        Route("/v1/models", models),
        Route("/stub/requests", received),
    ]
    if args.reset_route:
        routes.append(Route("/reset_prefix_cache", reset, methods=["POST"]))
        routes.append(Route("/stub/resets", lambda _: JSONResponse(counters.resets)))
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
    parser.add_argument("--invalid-tools-every", type=int, default=0, help="every Nth tool answer is invalid")
    parser.add_argument("--tools-differ-every", type=int, default=0, help="every Nth tool answer differs unstreamed")
    parser.add_argument("--reset-route", action="store_true", help="answer POST /reset_prefix_cache (else 404)")
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
