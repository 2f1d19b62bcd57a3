"""Helpers for the server tests."""

from __future__ import annotations

import json
import socket
import time

import httpx

API_KEY = "test-key"
MODEL = "SmolLM2-135M-Instruct"
SMALL_GRACE_S = 8  # the small server's --shutdown-timeout: the 12-token stream finishes within it, 2,000 tokens cannot

# Prompts whose greedy continuations are clear-cut (no near-ties in the first tokens).
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "List three primary colors:",
    "Translate to French: Good morning, my friend.",
    "Explain why the sky is blue in one sentence.",
    "Once upon a time, in a small village,",
    "The quick brown fox",
    "1, 2, 3, 4, 5,",
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def metric(text: str, name: str, required: bool = True, **labels: str) -> float:
    """The sum of a metric's samples whose labels include `labels`, from Prometheus text; a
    labelled counter that never counted is absent (0 when not `required`)."""
    total, found = 0.0, False
    for line in text.splitlines():
        if line.startswith("#") or not (line.startswith(name + "{") or line.startswith(name + " ")):
            continue
        sample, _, value = line.rpartition(" ")
        if all(f'{k}="{v}"' in sample for k, v in labels.items()):
            total, found = total + float(value), True
    assert found or not required, f"{name} {labels} not in /metrics"
    return total


def wait_idle(base_url: str, timeout_s: float = 30.0) -> str:
    """/metrics once no sequence runs or waits and no KV block is held; fails after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = httpx.get(f"{base_url}/metrics", timeout=10).text
        busy = [
            metric(text, f"pagoda:{n}") for n in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
        ]
        if busy == [0, 0, 0] or time.monotonic() > deadline:
            return text
        time.sleep(0.05)


def sse_events(lines) -> list[dict | str]:
    """The data of each SSE event: parsed JSON, or the raw string ([DONE])."""
    events: list[dict | str] = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events
