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
