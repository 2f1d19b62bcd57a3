"""`pagoda analyze` end to end: the table, --json, --plot, and clear errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pagoda.analyze.cli import main

from .conftest import write_log

SYSTEM = list(range(1000, 1040))  # 40 tokens: 2 whole blocks of 16, and 8 more


def pagoda_line(prompt: list[int], output: list[int], cached: int, stamp: float) -> dict:
    return {
        "timestamp": stamp,
        "endpoint": "/v1/completions",
        "request_id": f"cmpl-{stamp}",
        "body": {"prompt": prompt, "max_tokens": len(output)},
        "prompt_token_ids": prompt,
        "prompt_tokens": len(prompt),
        "cached_tokens": cached,
        "output_tokens": len(output),
        "output_token_ids": output,
        "ttft_s": 0.01,
        "latency_s": 0.1,
    }


@pytest.fixture
def token_log(tmp_path) -> Path:
    """Four requests: three share SYSTEM (40 tokens), one shares nothing; line 3 is broken."""
    return write_log(
        tmp_path / "requests.jsonl",
        [
            pagoda_line(SYSTEM + [1, 2], [7, 8], 0, 1.0),
            pagoda_line(SYSTEM + [3, 4], [7, 8], 32, 2.0),
            '{"prompt_token_ids": [1, 2',
            pagoda_line(SYSTEM[:20] + [5], [9], 0, 3.0),  # the server said 0; the prediction is 16
            pagoda_line(list(range(5000, 5030)), [1, 2, 3, 4], 0, 4.0),
        ],
    )


def run(args: list[str], capsys) -> tuple[int, str, str]:
    code = main(args)
    out, err = capsys.readouterr()
    return code, out, err


def test_json_report_has_exact_predictions(token_log, capsys):
    code, out, _ = run([str(token_log), "--json", "--cache-tokens", "16,1k"], capsys)
    assert code == 0
    report = json.loads(out)
    assert report["upper_bound"] is True
    assert (report["requests"], report["prompt_tokens"], report["output_tokens"]) == (4, 42 + 42 + 21 + 30, 9)
    assert report["prefill_share"] == pytest.approx(135 / 144)
    # Token granularity: 40 + 20 reused; 16-token blocks: 32 + 16.
    assert report["unlimited"]["token"] == {"tokens": 60, "share": pytest.approx(60 / 135)}
    assert report["unlimited"]["block"] == {"tokens": 48, "share": pytest.approx(48 / 135)}
    curve = {point["cache_tokens"]: point for point in report["capacity_curve"]}
    assert curve[1000]["block"]["tokens"] == 48
    assert curve[16]["block"]["tokens"] == 16 + 16  # one block: the system prompt's first
    assert report["malformed_lines"] == 1 and report["malformed"][0]["line"] == 3
    assert report["hit_ratios"]["block"]["no_reuse"] == 2
    assert report["shared_prefixes"][0]["tokens"] == 40 and report["shared_prefixes"][0]["requests"] == 2
    check = report["server_check"]
    assert (check["requests"], check["exact"], check["logged_cached_tokens"]) == (4, 3, 32)
    assert check["differences"] == [[4, 16, 0]]
    # Four requests are too few to recommend on: a caveat stands in the recommendation's place.
    assert report["recommendation"]["verdict"].startswith("Too few requests to recommend: 4 logged")


def test_table_report(token_log, capsys):
    code, out, _ = run([str(token_log)], capsys)
    assert code == 0
    assert "An upper bound" in out
    assert "  requests          4\n" in out
    assert "line 3: not valid JSON" in out
    assert "  unlimited cache                      60  44.4%             48  35.6%" in out
    assert "token ids 1000 1001 1002" in out  # no tokenizer was needed, so the prefix shows as ids
    assert "line 4: predicted 16, logged 0" in out
    assert "Too few requests to recommend" in out and "A heuristic, not a law" not in out


def test_a_named_tokenizer_default_too_shows_prefixes_as_text(token_log, default_tokenizer, capsys):
    code, out, _ = run([str(token_log), "--tokenizer", "default"], capsys)
    assert code == 0 and "token ids 1000" not in out
    assert json.dumps(default_tokenizer.decode(SYSTEM[:4]))[1:-1] in out  # the preview is quoted as JSON


def test_a_plot_in_a_format_it_cannot_write_fails_before_the_read(token_log, tmp_path, capsys):
    code, _, err = run([str(token_log), "--plot", str(tmp_path / "plot.txt")], capsys)
    assert code == 1 and "--plot writes .png, .svg, .pdf files (by the suffix), not plot.txt" in err
    assert not (tmp_path / "plot.txt").exists()
    code, _, _ = run([str(token_log), "--plot", str(tmp_path / "plot.svg"), "--json"], capsys)
    assert code == 0 and (tmp_path / "plot.svg").read_text().lstrip().startswith("<?xml")


def test_a_plot_without_its_folder_fails_before_the_read(token_log, tmp_path, capsys):
    code, out, err = run([str(token_log), "--plot", str(tmp_path / "no-such" / "x.png")], capsys)
    assert code == 1 and out == "" and f"there is no folder {tmp_path / 'no-such'}" in err


@pytest.fixture
def busy_log(tmp_path) -> Path:
    """24 requests, each SYSTEM and a question of its own: enough to recommend on."""
    lines = [pagoda_line(SYSTEM + [i, i + 1], [7, 8], 0, float(i)) for i in range(24)]
    return write_log(tmp_path / "busy.jsonl", lines)


def test_recommendation_with_enough_requests(busy_log, capsys):
    code, out, _ = run([str(busy_log), "--cache-tokens", "64,1k"], capsys)
    assert code == 0
    recommendation = " ".join(out[out.index("Recommendation (an upper bound)") :].split())
    for phrase in (
        "TTFT",
        "Total work",
        "A heuristic, not a law",
        "above about 60% shared-prefix traffic",
        "decode-heavy",
    ):
        assert phrase in recommendation
    assert "Too few requests" not in recommendation


@pytest.mark.parametrize("tokenizer", [[], ["--tokenizer", "default"]])
def test_capacity_names_the_kv_flag_in_gib(busy_log, tokenizer, capsys):
    from pagoda.analyze.kv_memory import kv_footprint

    kv = kv_footprint(None)  # Pagoda's default model: 30 layers x 3 KV heads x 64 x 4 bytes x 2
    assert kv is not None and kv.bytes_per_token == 46080
    code, out, _ = run([str(busy_log), "--json", "--cache-tokens", "64,1k", *tokenizer], capsys)
    assert code == 0
    capacity = next(r for r in json.loads(out)["recommendation"]["reasons"] if r.startswith("Capacity"))
    assert "a cache of 64 tokens keeps 90%" in capacity  # SYSTEM's 2 whole blocks
    # no less than the server needs to start: one sequence of the model's 8,192-token context
    assert kv.max_model_len == 8192 and "must hold one sequence of the context, 8,192 tokens" in capacity
    assert f"`--kv-cache-memory {kv.gib_for(8192 + 16):.2f}` (GiB) for SmolLM2-135M-Instruct (45 KiB" in capacity


def test_kv_size_rounds_up_to_a_hundredth_of_a_gib():
    from pagoda.analyze.kv_memory import KVFootprint

    kv = KVFootprint("m", 1024)
    assert kv.gib_for(2**20) == 1.0 and kv.gib_for(2**20 + 1) == 1.01 and kv.gib_for(1) == 0.01


def test_default_tokenizer_is_pagodas_default_model(tmp_path, capsys):
    log = write_log(tmp_path / "text.jsonl", [{"prompt": "Hello there, how are you?"}] * 2)
    named = run([str(log), "--json", "--tokenizer", "default"], capsys)
    unnamed = run([str(log), "--json"], capsys)
    assert named[0] == unnamed[0] == 0
    assert json.loads(named[1])["prompt_tokens"] == json.loads(unnamed[1])["prompt_tokens"] > 0


def test_plot_is_a_png(token_log, tmp_path, capsys):
    from matplotlib.image import imread

    plot = tmp_path / "overlap.png"
    code, out, _ = run([str(token_log), "--plot", str(plot)], capsys)
    assert code == 0 and f"Plot written to {plot}" in out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width, _ = imread(plot).shape
    assert width > height > 100


def test_block_size_option(token_log, capsys):
    code, out, _ = run([str(token_log), "--json", "--block-size", "8"], capsys)
    assert code == 0
    assert json.loads(out)["unlimited"]["block"]["tokens"] == 40 + 16


def test_all_lines_malformed_is_an_error(tmp_path, capsys):
    log = write_log(tmp_path / "bad.jsonl", ["nope", '{"model": "x"}'])
    code, out, err = run([str(log)], capsys)
    assert code == 1 and out == ""
    assert "all 2 requests in it are malformed:\n  line 1: " in err and "\n  line 2: " in err  # each with its reason


def test_missing_file_is_an_error(tmp_path, capsys):
    code, _, err = run([str(tmp_path / "absent.jsonl")], capsys)
    assert code == 1 and "Cannot read" in err and "No such file" in err


@pytest.mark.parametrize(
    "args",
    [["--block-size", "0"], ["--cache-tokens", "2x"], ["--cache-tokens", "0"], ["--cache-threshold", "5"]],
)
def test_bad_options_exit_2(token_log, args, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([str(token_log), *args])
    assert exit_.value.code == 2


def test_cache_sizes_take_suffixes(token_log, capsys):
    code, out, _ = run([str(token_log), "--json", "--cache-tokens", "1.5k,2M,64"], capsys)
    assert [p["cache_tokens"] for p in json.loads(out)["capacity_curve"]] == [64, 1500, 2_000_000]


def run_process(args: list[str]) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "pagoda.entrypoints.cli", "analyze", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)


def test_empty_file_is_a_clear_error_without_traceback(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    done = run_process([str(empty)])
    assert done.returncode == 1
    expected = f"No requests to analyze in {empty}: it has no requests (only blank lines, or none)."
    assert done.stderr.strip() == f"pagoda analyze: error: {expected}"
    assert "Traceback" not in done.stderr


def test_unknown_tokenizer_is_a_clear_error(token_log, capsys):
    code, out, err = run([str(token_log), "--tokenizer", "/no/such/model"], capsys)
    assert code == 1 and out == ""
    assert err.startswith("pagoda analyze: error: Cannot load the tokenizer of /no/such/model: no such file")


def test_a_chat_template_that_does_not_compile_is_an_error(token_log, tmp_path, capsys):
    """As `pagoda serve --chat-template` refuses it at startup (a file's line is named)."""
    code, out, err = run([str(token_log), "--chat-template", "{% for m in messages %}{{ m.content }"], capsys)
    assert code == 1 and out == ""
    assert "The inline chat template does not compile (line 1): unexpected '}'" in err
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}\n{{ m.content }\n")
    code, _, err = run([str(token_log), "--chat-template", str(broken)], capsys)
    assert code == 1 and f"The chat template {broken} does not compile (line 2)" in err
    fine = "{# " + "a long comment " * 30 + "#}"  # longer than a file name may be: a template, not a path
    fine += "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% break %}{% endfor %}"
    assert run([str(token_log), "--chat-template", fine, "--json"], capsys)[0] == 0  # transformers' extensions


@pytest.mark.slow
def test_chat_log_is_tokenized_as_the_server_would(tmp_path, default_tokenizer, capsys):
    from pagoda.model_files import apply_chat_template

    system = {"role": "system", "content": "You answer questions about the capitals of European countries."}
    questions = ["What is the capital of France?", "What is the capital of Spain?"]
    bodies = [{"model": "m", "messages": [system, {"role": "user", "content": q}]} for q in questions]
    log = write_log(tmp_path / "chat.jsonl", bodies)
    first, second = (apply_chat_template(default_tokenizer, body["messages"]) for body in bodies)
    common = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
    code, out, _ = run([str(log), "--json"], capsys)
    assert code == 0
    report = json.loads(out)
    assert report["prompt_tokens"] == len(first) + len(second)
    assert report["unlimited"]["token"]["tokens"] == common
    assert report["unlimited"]["block"]["tokens"] == common // 16 * 16
    assert report["shared_prefixes"][0]["text"].startswith("<|im_start|>system\nYou answer questions")
