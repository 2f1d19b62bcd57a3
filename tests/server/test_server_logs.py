"""What `pagoda serve` logs: the periodic engine line (rates from successive snapshots), the load
heartbeat, and one line per rejected request (never its prompt)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

import httpx

from pagoda.core.outputs import SchedulerStats
from pagoda.entrypoints.openai import serve
from pagoda.entrypoints.openai.startup import LoadProgress
from pagoda.entrypoints.openai.stats_log import Snapshot, log_stats, stats_line

BUSY = SchedulerStats(
    num_running=3,
    num_waiting=1,
    kv_usage=0.4125,
    num_preemptions=2,
    prefix_cache_queries=400,
    prefix_cache_hits=150,
    prompt_tokens=5000,
    generation_tokens=900,
)


def test_the_engine_line_has_vllms_fields_with_rates_over_the_interval():
    before = Snapshot(SchedulerStats(num_preemptions=1, prompt_tokens=1000, generation_tokens=100), 50.0)
    line = stats_line(before, Snapshot(BUSY, 60.0), "CPU")
    assert line == (
        "Avg prompt throughput: 400.0 tokens/s, Avg generation throughput: 80.0 tokens/s, Running: 3 reqs, "
        "Waiting: 1 reqs, Preemptions: 1, CPU KV cache usage: 41.2%, Prefix cache hit rate: 37.5%"
    )
    assert "hit rate" not in stats_line(before, Snapshot(SchedulerStats(), 60.0), "GPU")  # nothing looked up yet


def test_the_engine_line_is_info_while_busy_and_debug_when_idle(caplog):
    current = {"stats": SchedulerStats()}

    async def run() -> None:
        task = asyncio.create_task(log_stats(lambda: current["stats"], "CPU", interval_s=0.05))
        await asyncio.sleep(0)  # its first snapshot: the idle engine
        for stats in (BUSY, dataclasses.replace(BUSY, num_running=0, num_waiting=0)):
            current["stats"] = stats
            await asyncio.sleep(0.3)
        task.cancel()

    with caplog.at_level(logging.DEBUG, logger="pagoda.stats"):
        asyncio.run(run())
    levels = [r.levelno for r in caplog.records if r.name == "pagoda.stats"]
    assert levels[0] == logging.INFO and levels[-1] == logging.DEBUG
    assert "Running: 3 reqs, Waiting: 1 reqs" in caplog.records[0].getMessage()


def test_disable_log_stats_turns_the_line_off():
    assert serve.server_config(serve.parse_args([])).log_stats
    assert not serve.server_config(serve.parse_args(["--disable-log-stats"])).log_stats


def test_a_quiet_load_step_is_reported_while_it_runs(caplog):
    async def run() -> None:
        async with LoadProgress(quiet_s=0.2).reporting("pagoda.test_load"):
            logging.getLogger("pagoda.test_load.loader").info("Packing linear weights")
            logging.getLogger("pagoda.test_load.loader").warning("a warning on the way is not a step")
            await asyncio.sleep(0.6)

    with caplog.at_level(logging.INFO):
        asyncio.run(run())
    beats = [r.getMessage() for r in caplog.records if r.name == "pagoda.serve"]
    assert beats and all(b.startswith("still loading (") and b.endswith("): Packing linear weights") for b in beats)


def wait_for_line(server, text: str, timeout_s: float = 10.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        lines = [line for line in server.log().splitlines() if text in line]
        if lines:
            return lines[-1]
        time.sleep(0.05)
    raise AssertionError(f"{text!r} not in the log")


def test_a_rejected_request_leaves_one_line_without_its_prompt(server, http):
    secret = "heron-parsnip-7781"
    response = http.post("/v1/completions", json={"prompt": secret, "max_tokens": -3})
    assert response.status_code == 400
    line = wait_for_line(server, "rejected POST /v1/completions: 400 max_tokens must be at least 1, got -3")
    assert secret not in server.log()
    unauthorized = httpx.post(f"{server.base_url}/v1/chat/completions", json={"messages": []})
    assert unauthorized.status_code == 401
    assert "Missing or incorrect API key" in wait_for_line(server, "rejected POST /v1/chat/completions: 401")
    assert http.post("/v1/chat/completions", json={"max_tokens": 2}).status_code == 400  # FastAPI's validation
    wait_for_line(server, "rejected POST /v1/chat/completions: 400 messages: Field required")
    assert line.count("rejected") == 1
