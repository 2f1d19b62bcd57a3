"""`pagoda bench --launch` against a real Pagoda server on the default model (CPU, slow)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from bench_helpers import read_results

from pagoda.bench import cli
from tests.server.helpers import free_port

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("pagoda.entrypoints.openai.serve") is None,
        reason="the Pagoda server (pagoda.entrypoints.openai.serve) does not exist yet",
    ),
]


def launching_pagoda() -> list[str]:
    """`pagoda bench` arguments that launch a Pagoda server of the default model on a free port."""
    port = free_port()
    launch = f"{sys.executable} -m pagoda.entrypoints.cli serve --host 127.0.0.1 --port {port}"
    return ["--launch", launch, "--launch-timeout", "600", "--base-url", f"http://127.0.0.1:{port}"]


def test_bench_launches_and_measures_a_pagoda_server(tmp_path: Path) -> None:
    code = cli.main(
        [
            *launching_pagoda(),
            "--endpoint",
            "chat",
            "--workload",
            "shared-prefix",
            "--groups",
            "2",
            "--prompts-per-group",
            "3",
            "--system-prompt-len",
            "64",
            "--question-len",
            "8",
            "--output-len",
            "8",
            "--concurrency",
            "1,3",
            "--warmup",
            "1",
            "--output",
            str(tmp_path),
            "--no-progress",
        ]
    )
    engine = read_results(tmp_path)["engines"][0]
    assert code == 0, engine["error"] or engine["levels"]
    assert engine["model"] == "SmolLM2-135M-Instruct" and engine["tokenizer"] == "default"
    assert 0 < engine["cold_start"]["ready_s"] < engine["cold_start"]["first_request_s"]
    assert engine["memory"]["rss_mib"] > 100  # a model is loaded
    for level in engine["levels"]:
        assert (level["summary"]["completed"], level["summary"]["failed"]) == (6, 0)
        for record in level["records"]:
            assert record["token_source"] == "usage" and 1 <= record["output_tokens"] <= 8
            assert 0 < record["ttft_s"] <= record["latency_s"]
            assert record["prompt_tokens"] > 64  # the system prompt, the question and the template
        # Two groups of three share a 64-token system prompt: later members hit the cache.
        assert level["prefix_cache"]["source"] == "pagoda counters"
        assert level["prefix_cache"]["hit_rate"] > 0.2


def test_every_structured_output_of_pagoda_is_valid(tmp_path: Path) -> None:
    """Pagoda constrains its output to the schema, so with max_tokens to spare every answer of
    every one of the workload's schemas parses and validates."""
    code = cli.main(
        [
            *launching_pagoda(),
            "--workload",
            "structured",
            "--num-prompts",
            "16",  # one round: every schema once
            "--concurrency",
            "4",
            "--warmup",
            "0",
            "--output",
            str(tmp_path),
            "--no-progress",
        ]
    )
    engine = read_results(tmp_path)["engines"][0]
    assert code == 0, engine["error"] or engine["levels"]
    level = engine["levels"][0]
    problems = [r["schema_error"] for r in level["records"] if not r["schema_valid"]]
    assert level["summary"]["completed"] == 16 and problems == []
    assert level["summary"]["schema_valid_rate"] == 1.0
    assert "| structured outputs valid (higher is better) | 100.0% |" in (tmp_path / "report.md").read_text()


def test_every_tool_call_of_pagoda_is_valid_and_streams_as_it_answers(tmp_path: Path) -> None:
    """With tool_choice "required" Pagoda forces its calls with a grammar, so every call of one
    round of the workload's tools parses and validates; at temperature 0 and concurrency 1 the
    non-streamed answer has the same calls, byte for byte."""
    code = cli.main(
        [
            *launching_pagoda(),
            "--workload",
            "tools",
            "--num-prompts",
            "12",  # one round: every tool asked for once
            "--concurrency",
            "1",
            "--warmup",
            "0",
            "--output",
            str(tmp_path),
            "--no-progress",
        ]
    )
    engine = read_results(tmp_path)["engines"][0]
    assert code == 0, engine["error"] or engine["levels"]
    level = engine["levels"][0]
    problems = [(r["tool_calls_error"], r["tool_calls_difference"]) for r in level["records"]]
    assert level["summary"]["completed"] == 12 and problems == [(None, None)] * 12
    assert level["summary"]["tool_calls_valid_rate"] == level["summary"]["tool_calls_agree_rate"] == 1.0
