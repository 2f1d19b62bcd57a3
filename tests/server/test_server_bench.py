"""`pagoda bench`'s structured and tool-call workloads against the shared server of conftest.py:
every answer Pagoda gives them is valid. (`tests/bench/test_bench_pagoda_e2e.py` launches a
server of its own to test `--launch`.)"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from pagoda.bench import cli
from tests.bench.bench_helpers import read_results
from tests.server.helpers import API_KEY

pytestmark = pytest.mark.slow


def bench(server, tmp_path: Path, *args: str) -> dict:
    """One level of `pagoda bench` against the server; its results.json level."""
    code = cli.main(
        ["--base-url", server.base_url, "--api-key", API_KEY, *args, "--warmup", "0"]
        + ["--output", str(tmp_path), "--no-progress"]
    )
    engine = read_results(tmp_path)["engines"][0]
    assert code == 0, engine["error"] or engine["levels"]
    return engine["levels"][0]


def test_every_structured_output_of_pagoda_is_valid(server, tmp_path: Path) -> None:
    """Pagoda constrains its output to the schema, so with max_tokens to spare every answer of
    every one of the workload's schemas parses and validates."""
    # one round: every schema once
    level = bench(server, tmp_path, "--workload", "structured", "--num-prompts", "16", "--concurrency", "4")
    problems = [r["schema_error"] for r in level["records"] if not r["schema_valid"]]
    assert level["summary"]["completed"] == 16 and problems == []
    assert level["summary"]["schema_valid_rate"] == 1.0
    assert "| structured outputs valid (higher is better) | 100.0% |" in (tmp_path / "report.md").read_text()


def test_every_tool_call_of_pagoda_is_valid_and_streams_as_it_answers(server, tmp_path: Path) -> None:
    """With tool_choice "required" Pagoda forces its calls with a grammar, so every call of one
    round of the workload's tools parses and validates; at temperature 0 the non-streamed answer
    has the same calls, byte for byte, though it runs in other batches than the streamed one (the
    server is deterministic: a request's output does not depend on its batch)."""
    models = httpx.get(f"{server.base_url}/v1/models", headers=server.headers).json()["data"]
    assert models[0]["deterministic"] is True
    level = bench(server, tmp_path, "--workload", "tools", "--num-prompts", "12", "--concurrency", "4")
    problems = [(r["tool_calls_error"], r["tool_calls_difference"]) for r in level["records"]]
    assert level["summary"]["completed"] == 12 and problems == [(None, None)] * 12
    assert level["summary"]["tool_calls_valid_rate"] == level["summary"]["tool_calls_agree_rate"] == 1.0
