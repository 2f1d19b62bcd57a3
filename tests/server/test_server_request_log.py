"""--request-log: one JSON line per finished request in the format `pagoda analyze` reads; the
per-request log line, without prompt text unless --log-prompts."""

from __future__ import annotations

import json
import time

import pytest

from pagoda.analyze.logs import parse_line
from tests.server.helpers import MODEL

pytestmark = pytest.mark.slow

MARKER = "zebra-marmalade-7731"  # appears only in these prompts
FIELDS = {
    "timestamp",
    "endpoint",
    "request_id",
    "body",
    "prompt_token_ids",
    "prompt_tokens",
    "cached_tokens",
    "output_tokens",
    "output_token_ids",
    "finish_reason",
    "ttft_s",
    "latency_s",
}


def records_for(server, request_id: str, count: int, timeout_s: float = 10.0) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while True:
        lines = server.request_log.read_text().splitlines() if server.request_log.exists() else []
        found = [json.loads(line) for line in lines if request_id in line]
        if len(found) >= count or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def test_chat_request_is_logged_with_its_body_and_tokens(client, http, server):
    messages = [{"role": "user", "content": f"Repeat {MARKER}"}]
    started = time.time()
    result = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, temperature=0)
    [record] = records_for(server, result.id, 1)
    assert set(record) == FIELDS
    assert record["endpoint"] == "/v1/chat/completions" and record["request_id"] == result.id
    assert record["body"] == {"model": MODEL, "messages": messages, "max_tokens": 3, "temperature": 0}
    assert record["prompt_token_ids"] == http.post("/tokenize", json={"messages": messages}).json()["tokens"]
    assert record["prompt_tokens"] == result.usage.prompt_tokens
    assert record["cached_tokens"] == result.usage.prompt_tokens_details.cached_tokens
    assert record["output_tokens"] == len(record["output_token_ids"]) == result.usage.completion_tokens
    assert (
        http.post("/detokenize", json={"tokens": record["output_token_ids"]}).json()["prompt"]
        == result.choices[0].message.content
    )
    assert record["finish_reason"] == "length"
    assert 0 < record["ttft_s"] <= record["latency_s"] and started <= record["timestamp"] <= time.time()
    [entry] = parse_line(json.dumps(record).encode(), 1)  # pagoda analyze reads it
    assert list(entry.prompt) == record["prompt_token_ids"] and entry.logged_cached_tokens == record["cached_tokens"]


def test_each_prompt_of_a_completion_is_its_own_record(client, server):
    prompts = [f"{MARKER} one", f"{MARKER} two"]
    result = client.completions.create(model=MODEL, prompt=prompts, max_tokens=2, n=2)
    records = sorted(records_for(server, result.id, 2), key=lambda r: r["request_id"])
    assert [r["request_id"] for r in records] == [f"{result.id}-0", f"{result.id}-1"]
    assert all(r["endpoint"] == "/v1/completions" and r["body"]["prompt"] == prompts for r in records)
    assert sum(r["output_tokens"] for r in records) == result.usage.completion_tokens == 8
    assert sum(r["prompt_tokens"] for r in records) == result.usage.prompt_tokens


def test_log_line_per_request_without_prompt_text(client, server):
    result = client.completions.create(model=MODEL, prompt=f"{MARKER} three", max_tokens=2)
    deadline = time.monotonic() + 10
    while result.id not in server.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    [line] = [line for line in server.log().splitlines() if result.id in line]
    prompt_tokens = result.usage.prompt_tokens
    for part in (
        f"prompt_tokens={prompt_tokens}",
        "cached_tokens=",
        "output_tokens=2",
        "ttft=",
        "e2e=",
        "finish_reason=length",
    ):
        assert part in line
    assert MARKER not in server.log()
