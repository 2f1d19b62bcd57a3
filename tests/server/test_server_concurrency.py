"""Many streams at once give each client its own correct output; a client that goes away ends
its request and frees its KV blocks."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.server.helpers import MODEL, PROMPTS, metric, wait_idle

pytestmark = pytest.mark.slow

MAX_TOKENS = 6
DISTINCT = PROMPTS[:4]  # 32 streams, 8 of each prompt


def test_32_concurrent_streams_equal_sequential_greedy(client, aclient):
    def one(prompt: str) -> tuple[str, str]:
        choice = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=MAX_TOKENS).choices[0]
        return choice.text, choice.finish_reason

    baseline = {p: one(p) for p in DISTINCT}
    assert len({text for text, _ in baseline.values()}) == len(DISTINCT)  # distinct, so a mix-up would show

    async def stream(api, prompt: str) -> tuple[str, str | None]:
        chunks = await api.completions.create(
            model=MODEL, prompt=prompt, temperature=0, max_tokens=MAX_TOKENS, stream=True
        )
        text, finish = "", None
        async for chunk in chunks:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        return text, finish

    async def all_streams() -> list[tuple[str, str | None]]:
        async with aclient() as api:
            return await asyncio.gather(*(stream(api, DISTINCT[i % len(DISTINCT)]) for i in range(32)))

    for i, result in enumerate(asyncio.run(all_streams())):
        assert result == baseline[DISTINCT[i % len(DISTINCT)]], i


def _held(base_url: str) -> tuple[float, float]:
    text = httpx.get(f"{base_url}/metrics").text
    return metric(text, "pagoda:num_requests_running"), metric(text, "pagoda:kv_cache_usage_perc")


def test_disconnect_mid_stream_aborts_and_frees_blocks(server):
    before = wait_idle(server.base_url)
    body = {"model": MODEL, "prompt": PROMPTS[5], "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.base_url, headers=server.headers, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body) as response:
            lines = response.iter_lines()  # kept referenced: a dropped iterator closes the connection
            events = (line for line in lines if line.startswith("data: "))
            for _ in range(3):
                next(events)
            running, usage = _held(server.base_url)
            assert running == 1 and usage > 0
    after = wait_idle(server.base_url, timeout_s=10)
    assert _held(server.base_url) == (0, 0)
    assert (
        metric(after, "pagoda:request_success_total", finished_reason="abort")
        == metric(before, "pagoda:request_success_total", False, finished_reason="abort") + 1
    )
    assert metric(after, "pagoda:generation_tokens_total") - metric(before, "pagoda:generation_tokens_total") < 100


def test_disconnect_while_waiting_for_a_non_streamed_answer(server):
    before = wait_idle(server.base_url)
    body = {"model": MODEL, "prompt": PROMPTS[6], "max_tokens": 1000, "ignore_eos": True}
    started = time.monotonic()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.base_url}/v1/completions", json=body, headers=server.headers, timeout=1.5)
    after = wait_idle(server.base_url, timeout_s=10)
    assert _held(server.base_url) == (0, 0) and time.monotonic() - started < 12
    assert "client closed POST /v1/completions before its response: aborted" in server.log()
    assert (
        metric(after, "pagoda:request_success_total", finished_reason="abort")
        == metric(before, "pagoda:request_success_total", False, finished_reason="abort") + 1
    )
