"""What a JSON-schema constraint costs on a running server (Pagoda, vLLM, any OpenAI-compatible one).

Three measurements, streaming chat requests, greedy:
- TPOT with and without a constraint at each concurrency: the same prompts twice, first constrained
  by a schema (`response_format`), then unconstrained with `ignore_eos` and, per request, the
  `max_tokens` its constrained output used, so both runs generate the same number of tokens;
- the share of constrained outputs that parse and validate against their schema;
- first-request latency (TTFT) for a schema the server has never seen (a fresh property name, so
  no cache of any kind holds it) against the same schema sent again.

    python benchmarks/structured_outputs.py --base-url http://127.0.0.1:8000 [--concurrency 1,8]
        [--num-requests 16] [--output results.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
import uuid

import httpx
import jsonschema

SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 16},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "email": {"type": "string", "maxLength": 24},
        },
        "required": ["name", "age", "email"],
    },
    {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 24},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "minItems": 1, "maxItems": 4},
            "rating": {"enum": [1, 2, 3, 4, 5]},
        },
        "required": ["title", "tags", "rating"],
    },
    {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 16},
            "country": {"type": "string", "maxLength": 16},
            "population": {"type": "integer", "minimum": 0, "maximum": 100000000},
            "capital": {"type": "boolean"},
        },
        "required": ["city", "country", "population", "capital"],
    },
    {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "product": {"type": "string", "maxLength": 12},
                        "quantity": {"type": "integer", "minimum": 1, "maximum": 9},
                    },
                    "required": ["product", "quantity"],
                },
                "minItems": 1,
                "maxItems": 3,
            }
        },
        "required": ["items"],
    },
]
TOPICS = ["a person", "a book", "a city", "a shopping order", "a film", "a friend", "a town", "a grocery list"]


def request_body(model: str, i: int, schema: dict | None, max_tokens: int, ignore_eos: bool = False) -> dict:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": f"Describe {TOPICS[i % len(TOPICS)]} as JSON."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    if schema is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "doc", "schema": schema}}
    if ignore_eos:
        body["ignore_eos"] = True
    return body


async def stream(http: httpx.AsyncClient, body: dict) -> dict:
    """One streamed request: its text, token count (content chunks) and times."""
    sent = time.perf_counter()
    times, text = [], []
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            delta = chunk["choices"][0]["delta"].get("content") if chunk.get("choices") else None
            if delta:
                times.append(time.perf_counter())
                text.append(delta)
    ttft = times[0] - sent if times else None
    tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None
    return {"text": "".join(text), "chunks": len(times), "ttft_s": ttft, "tpot_s": tpot}


async def run_level(http: httpx.AsyncClient, bodies: list[dict], concurrency: int) -> list[dict]:
    slots = asyncio.Semaphore(concurrency)

    async def one(body: dict) -> dict:
        async with slots:
            return await stream(http, body)

    return await asyncio.gather(*(one(b) for b in bodies))


def tokens_used(http_sync: httpx.Client, model: str, text: str) -> int:
    response = http_sync.post("/tokenize", json={"model": model, "prompt": text, "add_special_tokens": False})
    return int(response.json()["count"]) if response.status_code == 200 else max(1, len(text) // 3)


def median_ms(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return round(statistics.median(present) * 1000, 2) if present else None


async def main_async(args: argparse.Namespace) -> dict:
    async with httpx.AsyncClient(base_url=args.base_url, timeout=600) as http:
        model = args.model or (await http.get("/v1/models")).json()["data"][0]["id"]
        results: dict = {"model": model, "levels": []}
        with httpx.Client(base_url=args.base_url, timeout=60) as http_sync:
            for concurrency in args.concurrency:
                schemas = [SCHEMAS[i % len(SCHEMAS)] for i in range(args.num_requests)]
                constrained = await run_level(
                    http, [request_body(model, i, s, args.max_tokens) for i, s in enumerate(schemas)], concurrency
                )
                valid = 0
                for out, schema in zip(constrained, schemas):
                    try:
                        jsonschema.validate(json.loads(out["text"]), schema)
                        valid += 1
                    except (ValueError, jsonschema.ValidationError):
                        pass
                lengths = [tokens_used(http_sync, model, out["text"]) + 1 for out in constrained]  # + end token
                free = await run_level(
                    http,
                    [request_body(model, i, None, n, ignore_eos=True) for i, n in enumerate(lengths)],
                    concurrency,
                )
                level = {
                    "concurrency": concurrency,
                    "requests": args.num_requests,
                    "valid_share": valid / args.num_requests,
                    "tpot_ms_constrained": median_ms([o["tpot_s"] for o in constrained]),
                    "tpot_ms_unconstrained": median_ms([o["tpot_s"] for o in free]),
                    "ttft_ms_constrained": median_ms([o["ttft_s"] for o in constrained]),
                    "ttft_ms_unconstrained": median_ms([o["ttft_s"] for o in free]),
                }
                level["tpot_ratio"] = round(level["tpot_ms_constrained"] / level["tpot_ms_unconstrained"], 3)
                results["levels"].append(level)
                print(json.dumps(level))
        new_property = {f"f{uuid.uuid4().hex[:8]}": {"type": "boolean"}}
        fresh = {**SCHEMAS[0], "properties": {**SCHEMAS[0]["properties"], **new_property}}
        cold = await stream(http, request_body(model, 0, fresh, 8))
        warm = await stream(http, request_body(model, 0, fresh, 8))
        results["new_schema_ttft_ms"] = round(cold["ttft_s"] * 1000, 1)
        results["cached_schema_ttft_ms"] = round(warm["ttft_s"] * 1000, 1)
        print(json.dumps({k: results[k] for k in ("new_schema_ttft_ms", "cached_schema_ttft_ms")}))
        return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default=None)
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8])
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--output", help="write the results as JSON here")
    args = ap.parse_args()
    results = asyncio.run(main_async(args))
    if args.output:
        with open(args.output, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
