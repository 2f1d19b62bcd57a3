"""What an operator coming from vLLM meets: `vllm bench serve`'s flag names, a wrong model named
at once, the prefix cache reset between levels, and warnings about figures not to trust."""

from __future__ import annotations

import os
import re
from pathlib import Path

import httpx
import pytest
from bench_helpers import run_bench, write_jsonl

from pagoda.bench import cli
from pagoda.bench.report import run_warnings
from pagoda.bench.run import EngineResult
from pagoda.bench.settings import UsageError, parse_settings

TOKENIZER = ("--tokenizer", "default")  # the stub serves no model a tokenizer could come from


@pytest.mark.parametrize(
    "alias, native",
    [
        (["--backend", "openai-chat"], ["--endpoint", "chat"]),
        (["--backend", "openai"], ["--endpoint", "completions"]),
        (["--backend", "vllm"], ["--endpoint", "completions"]),
        (["--dataset-name", "prefix_repetition"], ["--workload", "shared-prefix"]),
        (["--dataset-name", "random"], ["--workload", "random"]),
        (["--dataset-name", "custom", "--dataset-path", "d.jsonl"], ["--workload", "replay", "--dataset", "d.jsonl"]),
        (["--dataset-name", "sharegpt", "--dataset-path", "s.json"], ["--workload", "sharegpt", "--dataset", "s.json"]),
        (["--random-input-len", "100", "--random-output-len", "10"], ["--input-len", "100", "--output-len", "10"]),
        (
            ["--random-input-len", "100", "--random-output-len", "10", "--random-range-ratio", "0.5"],
            ["--input-len", "50:150", "--output-len", "5:15"],
        ),
        (
            ["--input-len", "100", "--output-len", "10", "--random-range-ratio", '{"output": 0.2}'],
            ["--input-len", "100", "--output-len", "8:12"],
        ),
        (["--max-concurrency", "4"], ["--concurrency", "4"]),
        (["--num-warmups", "0"], ["--warmup", "0"]),
        (["--goodput", "ttft:500", "e2el:5000"], ["--slo", "ttft=500ms,e2e=5s"]),
        (["--result-dir", "out"], ["--output", "out"]),
        (["--save-result"], ["--output", "."]),
    ],
)
def test_vllm_bench_names_give_the_native_settings(alias: list[str], native: list[str]) -> None:
    assert parse_settings(alias) == parse_settings(native)


def test_result_filename_names_the_results_json(start_stub, tmp_path: Path) -> None:
    settings = parse_settings(["--result-filename", "run1.json"])
    assert settings.output == Path(".") and settings.results_file == "run1.json"
    stub = start_stub("--ttft", "0.01", "--itl", "0.001")
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "max_tokens": 2}])
    argv = ["--base-url", stub.base_url, "--dataset", str(data), "--num-warmups", "0", "--no-progress"]
    assert cli.main([*argv, "--result-dir", str(tmp_path / "out"), "--result-filename", "run1.json"]) == 0
    assert (tmp_path / "out" / "run1.json").is_file() and not (tmp_path / "out" / "results.json").exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--backend", "openai-chat", "--endpoint", "completions"], "--endpoint completions and --backend"),
        (["--dataset-name", "sharegpt", "--workload", "random"], "--workload random and --dataset-name"),
        (["--goodput", "ttft:5", "--slo", "ttft=5"], "--slo and --goodput are the same setting"),
        (["--goodput", "latency:5"], "--goodput wants ttft:MS"),
        (["--random-range-ratio", "1.5"], "--random-range-ratio wants R in [0, 1)"),
        (["--random-input-len", "10:20", "--random-range-ratio", "0.1"], "widens a single length N"),
        (["--backend", "openai-audio"], "invalid choice"),
    ],
)
def test_vllm_names_that_conflict_or_do_not_apply_are_usage_errors(args: list[str], message: str) -> None:
    with pytest.raises(UsageError, match=re.escape(message)):
        parse_settings(args)


def test_an_unknown_flag_suggests_the_close_one(capsys) -> None:
    assert cli.main(["--random-input-length", "5"]) == 2
    assert "--random-input-length: did you mean --random-input-len?" in capsys.readouterr().err


def test_a_model_the_server_does_not_serve_is_named_before_any_request(start_stub, capsys) -> None:
    stub = start_stub("--ttft", "0.01", "--itl", "0.001")
    assert cli.main(["--base-url", stub.base_url, "--model", "other-model", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"pagoda bench: error: {stub.base_url} does not serve the model 'other-model'; it serves stub-model"]
    assert httpx.get(f"{stub.base_url}/stub/requests").json() == []


def test_reset_prefix_cache_before_each_level(start_stub) -> None:
    stub = start_stub("--ttft", "0.01", "--itl", "0.001", "--reset-route")
    result = run_bench(stub.base_url, "--num-prompts", "2", "--concurrency", "1,2", "--reset-prefix-cache", *TOKENIZER)
    assert result.status == "ok" and len(result.levels) == 2
    assert httpx.get(f"{stub.base_url}/stub/resets").json() == 2


def test_a_server_without_the_reset_route_gets_one_warning(start_stub, capsys) -> None:
    stub = start_stub("--ttft", "0.01", "--itl", "0.001")
    result = run_bench(stub.base_url, "--num-prompts", "2", "--concurrency", "1,2", "--reset-prefix-cache", *TOKENIZER)
    assert result.status == "ok" and len(result.levels) == 2
    warnings = [line for line in capsys.readouterr().err.splitlines() if "reset_prefix_cache" in line]
    assert warnings == [f"warning: {stub.base_url} has no /reset_prefix_cache (404); its prefix cache is not reset"]


@pytest.mark.parametrize("hit_percent, warned", [("50", True), ("0", False)])
def test_a_hit_rate_above_the_workloads_share_is_a_warm_cache(start_stub, hit_percent: str, warned: bool) -> None:
    stub = start_stub("--ttft", "0.01", "--itl", "0.001", "--hit-percent", hit_percent)
    result = run_bench(stub.base_url, "--num-prompts", "4", "--input-len", "12", *TOKENIZER)
    assert result.ideal_prefix_share is not None and result.ideal_prefix_share < 0.2  # random prompts
    warnings = [w for w in run_warnings(result) if "held prompts from an earlier run" in w]
    assert bool(warnings) == warned
    if warned:
        assert warnings[0].startswith("stub: at concurrency 1 the prefix cache hit ")
        assert "% of prompt tokens, more than the workload's 0.0%" in warnings[0]


def test_a_load_average_above_the_cores_is_a_warning() -> None:
    cores = os.cpu_count() or 1
    busy = EngineResult("e", "http://x", peak_load_average=cores + 0.5)
    assert run_warnings(busy) == [
        f"e: the load average reached {cores + 0.5:.1f} on {cores} CPUs during the run: other work competed "
        "with the server and the client, so the figures understate the machine"
    ]
    assert run_warnings(EngineResult("e", "http://x", peak_load_average=cores - 0.5)) == []
