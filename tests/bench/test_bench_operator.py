"""What an operator coming from vLLM meets: `vllm bench serve`'s flag names, a wrong model named
at once, the prefix cache reset between levels, and warnings about figures not to trust."""

from __future__ import annotations

import json
import os
import random
import re
from pathlib import Path

import httpx
import pytest
from bench_helpers import run_bench, write_jsonl

from pagoda.bench import cli
from pagoda.bench.datasets import load_workload
from pagoda.bench.errors import BenchError
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
        (["--dataset-name", "custom", "--dataset-path", "d.jsonl"], ["--workload", "custom", "--dataset", "d.jsonl"]),
        (["--backend", "openai-chat", "--endpoint", "/v1/chat/completions"], ["--endpoint", "chat"]),
        (["--endpoint", "/v1/completions"], ["--endpoint", "completions"]),
        (["--host", "10.0.0.2", "--port", "9000"], ["--base-url", "http://10.0.0.2:9000"]),
        (["--served-model-name", "m", "--model", "org/m"], ["--model", "m", "--tokenizer", "org/m"]),
        (
            ["--top-p", "0.9", "--top-k", "20", "--min-p", "0.1"],
            ["--extra-body", '{"top_p": 0.9, "top_k": 20, "min_p": 0.1}'],
        ),
        (["--disable-tqdm"], ["--no-progress"]),
        (["--trust-remote-code", "--tokenizer-mode", "auto", "--no-oversample"], []),
        (["--random-range-ratio", "0.5"], ["--input-len", "128:384", "--output-len", "32:96"]),  # the defaults too
        (
            ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "100"]
            + ["--prefix-repetition-suffix-len", "10", "--prefix-repetition-num-prefixes", "3"]
            + ["--prefix-repetition-output-len", "5"],
            ["--workload", "shared-prefix", "--system-prompt-len", "100", "--question-len", "10", "--groups", "3"]
            + ["--output-len", "5"],
        ),
        (
            ["--dataset-name", "sharegpt", "--dataset-path", "s.json", "--sharegpt-output-len", "7"],
            ["--workload", "sharegpt", "--dataset", "s.json", "--output-len", "7"],
        ),
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
    ],
)
def test_vllm_bench_names_give_the_native_settings(alias: list[str], native: list[str]) -> None:
    assert parse_settings(alias) == parse_settings(native)


def test_a_request_rate_alone_bounds_nothing_in_flight() -> None:
    """vLLM's default: without --max-concurrency, arrivals at --request-rate are never held back."""
    assert parse_settings([]).concurrency == (1,)
    assert parse_settings(["--request-rate", "8", "--num-prompts", "16"]).concurrency == (16,)
    assert not parse_settings(["--request-rate", "8"]).in_flight_bound
    assert parse_settings(["--request-rate", "8", "--max-concurrency", "4"]).concurrency == (4,)


def test_save_result_writes_vllms_result_json(start_stub, tmp_path: Path, monkeypatch) -> None:
    """Named as vLLM names it, its fields as vLLM writes them, one file a level; --result-filename
    names it (-cN for each of several levels); --append-result adds a line."""
    stub = start_stub("--ttft", "0.02", "--itl", "0.005")
    monkeypatch.chdir(tmp_path)
    argv = ["--base-url", stub.base_url, "--num-warmups", "0", "--no-progress", *TOKENIZER]
    small = ["--random-input-len", "8", "--random-output-len", "4", "--num-prompts", "4"]
    assert cli.main([*argv, *small, "--save-result", "--metric-percentiles", "50,99", "--metadata", "run=a"]) == 0
    [written] = tmp_path.glob("*.json")
    assert re.fullmatch(r"openai-infqps-concurrency1-stub-model-\d{8}-\d{6}\.json", written.name), written.name
    data = json.loads(written.read_text())
    assert (data["backend"], data["model_id"], data["num_prompts"], data["max_concurrency"]) == (
        "openai",
        "stub-model",
        4,
        1,
    )
    assert (data["completed"], data["failed"], data["total_output_tokens"], data["run"]) == (4, 0, 16, "a")
    # vLLM's peaks: per one-second bucket from the first send (requests one after another count together)
    assert data["request_rate"] == "inf" and 1 <= data["max_concurrent_requests"] <= 4
    assert 4 <= data["max_output_tokens_per_s"] <= 16
    assert 15 < data["mean_ttft_ms"] < 500 and 3 < data["median_itl_ms"] < 100 and data["p50_tpot_ms"] > 0
    assert {"std_ttft_ms", "p99_ttft_ms", "p99_itl_ms"} <= set(data) and "mean_e2el_ms" not in data
    assert "ttfts" not in data and "generated_texts" not in data  # per-request lists with --save-detailed only
    assert not (tmp_path / "results.json").exists()  # only vLLM's file
    # a request rate without --max-concurrency: none in the name, null in the file
    out = tmp_path / "out"
    rated = [*argv, *small, "--request-rate", "50", "--save-result", "--result-dir", str(out), "--save-detailed"]
    assert cli.main(rated) == 0
    assert "| metric | no bound |" in (out / "report.md").read_text()  # not a concurrency of 4
    [rate_file] = out.glob("openai-50.0qps-stub-model-*.json")
    data = json.loads(rate_file.read_text())
    assert data["max_concurrency"] is None and len(data["ttfts"]) == 4 and len(data["itls"][0]) == 3
    texts = data["generated_texts"]  # the stub's answers, as they streamed
    assert len(texts) == 4 and all(isinstance(t, str) and t for t in texts), texts
    # named, two levels, appended twice
    named = [*argv, *small, "--concurrency", "1,2", "--result-filename", "run.json", "--append-result"]
    assert cli.main(named) == 0 and cli.main(named) == 0
    for level in (1, 2):
        lines = (tmp_path / f"run-c{level}.json").read_text().splitlines()
        assert [json.loads(line)["max_concurrency"] for line in lines] == [level, level]


def test_vllms_custom_dataset_sends_its_prompts_as_vllm_does(start_stub, tmp_path: Path) -> None:
    """`--dataset-name custom`: {"prompt", "output_tokens"} lines, shuffled by the seed, in the chat
    template to the completions endpoint, max_tokens --custom-output-len or each line's."""
    stub = start_stub("--ttft", "0.01", "--itl", "0.001")
    rows = [{"prompt": f"question {i}", "output_tokens": i + 1} for i in range(6)]
    data = write_jsonl(tmp_path / "custom.jsonl", rows)
    base = ["--dataset-name", "custom", "--dataset-path", str(data), "--tokenizer", "default"]
    result = run_bench(stub.base_url, *base, "--custom-output-len", "-1")
    assert result.status == "ok"
    bodies = httpx.get(f"{stub.base_url}/stub/requests").json()
    order = list(range(6))
    random.Random(0).shuffle(order)  # vLLM's shuffle of the file by its --seed (0)
    assert [b["max_tokens"] for b in bodies] == [i + 1 for i in order]
    assert all(b["prompt"].startswith("<|im_start|>") and "output_tokens" not in b for b in bodies)  # the template
    assert f"question {order[0]}<|im_end|>" in bodies[0]["prompt"]
    run_bench(stub.base_url, *base, "--skip-chat-template", "--disable-shuffle", "--endpoint", "chat")
    chat = httpx.get(f"{stub.base_url}/stub/requests").json()[6:]
    assert [b["messages"] for b in chat] == [[{"role": "user", "content": f"question {i}"}] for i in range(6)]
    assert {b["max_tokens"] for b in chat} == {256}  # vLLM's default --custom-output-len
    write_jsonl(data, [{"prompt": "no length"}])
    with pytest.raises(BenchError, match="no 'output_tokens'"):
        load_workload(parse_settings([*base, "--custom-output-len", "-1"]).workload)


def test_vllm_flags_it_does_not_take_say_why(capsys) -> None:
    assert cli.main(["--ramp-up-strategy", "linear"]) == 2
    assert "--ramp-up-strategy is a vLLM flag" in capsys.readouterr().err


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


def test_headers_go_with_every_request_and_no_proxy_is_taken_from_the_environment(monkeypatch) -> None:
    import asyncio

    from aiohttp import web
    from bench_helpers import closed_port, http_server

    from pagoda.bench.client import list_models, make_client

    settings = parse_settings(["--header", "X-Tenant=a", "X-Trace=b=c"])
    assert settings.headers == (("X-Tenant", "a"), ("X-Trace", "b=c"))
    seen: list[tuple[str | None, str | None]] = []

    async def handle(request: web.Request) -> web.StreamResponse:
        seen.append((request.headers.get("x-tenant"), request.headers.get("x-trace")))
        return web.json_response({"data": [{"id": "m"}]})

    async def go() -> list[list[str] | None]:
        async with http_server(handle) as url, make_client(1, 5.0, settings.headers) as http:
            return [await list_models(http, url, None) for _ in range(2)]

    for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY"):  # a proxy that would refuse every request
        monkeypatch.setenv(name, f"http://127.0.0.1:{closed_port()}")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    assert asyncio.run(go()) == [["m"], ["m"]]
    assert seen == [("a", "b=c")] * 2
    with pytest.raises(UsageError, match="--header wants KEY=VALUE"):
        parse_settings(["--header", "novalue"])


def test_ready_check_waits_for_the_server_then_gives_up(start_stub) -> None:
    """vLLM's --ready-check-timeout-sec: a server that answers is used at once; none, after S."""
    import asyncio
    import time

    from pagoda.bench.client import make_client
    from pagoda.bench.run import _wait_until_answering

    async def wait(base_url: str, seconds: str) -> None:
        async with make_client(1, 5.0) as http:
            await _wait_until_answering(
                http, parse_settings(["--base-url", base_url, "--ready-check-timeout-sec", seconds])
            )

    stub = start_stub("--ttft", "0.01", "--itl", "0.001")
    asyncio.run(wait(stub.base_url, "5"))
    started = time.monotonic()
    with pytest.raises(BenchError, match="cannot reach"):
        asyncio.run(wait("http://127.0.0.1:9", "1.5"))  # the discard port: nothing listens
    assert time.monotonic() - started >= 1.5
