"""The `pagoda bench` command as a user meets it: exit codes, messages, launch, Ctrl-C."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from bench_helpers import read_results, stub_command, write_jsonl

from pagoda.bench import cli
from tests.server.helpers import free_port

PAGODA = [sys.executable, "-m", "pagoda.entrypoints.cli"]


def pagoda(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = os.environ | {"HF_HUB_OFFLINE": "1"}
    return subprocess.run([*PAGODA, *args], capture_output=True, text=True, timeout=timeout, env=env)


def test_importing_the_commands_loads_neither_torch_nor_transformers() -> None:
    code = (
        "import sys, pagoda.bench.cli, pagoda.bench.bakeoff; "
        "print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    )
    assert (
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "[]"
    )


def test_unreachable_server_fails_fast_with_a_clear_message() -> None:
    began = time.monotonic()
    done = pagoda("bench", "--base-url", f"http://127.0.0.1:{free_port()}", "--no-progress", timeout=30)
    assert done.returncode == 2
    assert "cannot reach http://127.0.0.1:" in done.stderr and "Is the server running there?" in done.stderr
    assert time.monotonic() - began < 20


def test_malformed_dataset_stops_before_sending(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "fine"}\n{"prompt": \n')
    assert cli.main(["--dataset", str(bad), "--base-url", "http://127.0.0.1:9"]) == 2
    assert f"{bad}:2: not valid JSON" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--concurrency", "0"], "--concurrency levels must be >= 1"),
        (["--concurrency", "a,b"], "--concurrency wants integers"),
        (["--input-len", "0"], "bad length"),
        (["--slo", "fast"], "bad SLO"),
        (["--extra-body", "[1]"], "--extra-body must be a JSON object"),
        (["--launch", "x", "--server-pid", "1"], "exclude each other"),
        (["--base-url", "localhost:8000"], "must start with http://"),
        (["--workload", "random", "--dataset", "x.jsonl"], "--dataset is for the replay, sharegpt and custom"),
        (["--bogus"], "unrecognized arguments: --bogus"),
        # both spellings of an option, differently (the same value twice is fine)
        (["--input-len", "32", "--random-input-len", "16"], "--input-len 32 and --random-input-len 16 disagree"),
        (["--concurrency", "1", "--max-concurrency", "2"], "--concurrency 1 and --max-concurrency 2 disagree"),
        (["--output", "a", "--result-dir", "b"], "--output a and --result-dir b disagree"),
    ],
)
def test_bad_options_are_usage_errors(args: list[str], message: str, capsys) -> None:
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert message in err and "usage: pagoda bench" in err


def test_launch_times_the_cold_start_and_stops_the_server(tmp_path: Path) -> None:
    port = free_port()
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a b", "max_tokens": 3}] * 2)
    launch = " ".join(stub_command("--startup-delay", "0.5", "--ttft", "0.01", "--itl", "0.001", port=port))
    assert (
        cli.main(
            [
                "--launch",
                launch,
                "--base-url",
                f"http://127.0.0.1:{port}",
                "--dataset",
                str(data),
                "--output",
                str(tmp_path),
                "--no-progress",
                "--warmup",
                "1",
            ]
        )
        == 0
    )
    engine = read_results(tmp_path)["engines"][0]
    cold = engine["cold_start"]
    assert 0.5 <= cold["ready_s"] < cold["first_request_s"] < 30
    assert engine["memory"]["rss_mib"] > 5  # a Python process tree
    # The launch command, its absolute paths without their folders
    python, stub, *options = launch.split()
    assert engine["launch_command"] == " ".join([f".../{Path(python).name}", f".../{Path(stub).name}", *options])
    assert (tmp_path / "server.log").exists()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2)


def test_api_keys_stay_out_of_the_results(start_stub, tmp_path: Path) -> None:
    stub = start_stub("--ttft", "0.01", "--itl", "0.001")
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "max_tokens": 2}])
    assert (
        cli.main(
            [
                "--base-url",
                stub.base_url,
                "--api-key",
                "s3cret-key",
                "--dataset",
                str(data),
                "--warmup",
                "0",
                "--no-progress",
                "--output",
                str(tmp_path / "out"),
            ]
        )
        == 0
    )
    written = [path.read_text() for path in (tmp_path / "out").iterdir() if path.suffix in (".json", ".md", ".csv")]
    assert len(written) == 3 and all("s3cret-key" not in text for text in written)
    results = read_results(tmp_path / "out")
    assert results["settings"]["api_key"] == "***" and "***" in results["command"]


@pytest.mark.parametrize(
    "command, timeout, message",
    [
        ("no-such-server-xyz --port 1", "30", "command not found: no-such-server-xyz"),
        (f"{sys.executable} -c \"print('boom'); raise SystemExit(3)\"", "30", "exited with code 3 before it answered"),
        (f'{sys.executable} -c "import time; time.sleep(60)"', "1", "did not answer GET"),
    ],
)
def test_launch_failures_are_clear_and_bounded(
    tmp_path: Path, capsys, command: str, timeout: str, message: str
) -> None:
    began = time.monotonic()
    code = cli.main(
        [
            "--launch",
            command,
            "--launch-timeout",
            timeout,
            "--base-url",
            f"http://127.0.0.1:{free_port()}",
            "--no-progress",
            "--output",
            str(tmp_path),
        ]
    )
    assert code == 2 and message in capsys.readouterr().err
    assert time.monotonic() - began < 20
    if "boom" in command:
        assert "boom" in (tmp_path / "server.log").read_text()
    results = read_results(tmp_path)
    assert results["engines"][0]["status"] == "failed"
    assert results["settings"]["launch"]["log_path"] == "server.log"  # relative to the report


def test_an_output_folder_that_cannot_be_written_fails_before_the_run(tmp_path: Path, capsys) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    began = time.monotonic()
    code = cli.main(["--base-url", f"http://127.0.0.1:{free_port()}", "--output", str(blocker / "sub")])
    assert code == 2 and f"cannot write results to {blocker / 'sub'}" in capsys.readouterr().err
    assert time.monotonic() - began < 5  # no run first (nothing listens there either: that would fail later)


def test_launch_refuses_a_port_something_already_listens_on(tmp_path: Path, capsys) -> None:
    """The launched server could not take the port, and the run would measure whatever holds it."""
    import socket

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        code = cli.main(
            [
                "--launch",
                f'{sys.executable} -c "import time; time.sleep(60)"',
                "--base-url",
                f"http://127.0.0.1:{port}",
                "--no-progress",
                "--output",
                str(tmp_path),
            ]
        )
    assert code == 2 and f"something already listens at 127.0.0.1:{port}" in capsys.readouterr().err
    assert not (tmp_path / "server.log").exists()  # nothing was launched


def test_ctrl_c_writes_the_requests_that_finished(start_stub, tmp_path: Path) -> None:
    stub = start_stub("--ttft", "0.2", "--itl", "0.001")
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "max_tokens": 2}] * 40)
    process = subprocess.Popen(
        [
            *PAGODA,
            "bench",
            "--base-url",
            stub.base_url,
            "--dataset",
            str(data),
            "--warmup",
            "0",
            "--no-progress",
            "--output",
            str(tmp_path / "out"),
        ],
        stderr=subprocess.PIPE,
        text=True,
        # SIGINT as a terminal's Ctrl-C finds it: a shell without job control starts background
        # commands (a CI script run with `&`) with SIGINT ignored, and children inherit that
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    for line in process.stderr:  # type: ignore[union-attr]
        if "replay of" in line:  # the run has started
            break
    time.sleep(0.7)
    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=20) == 130
    level = read_results(tmp_path / "out")["engines"][0]["levels"][0]
    assert level["interrupted"] and 1 <= level["summary"]["completed"] < 40
    assert json.loads((tmp_path / "out" / "results.json").read_text())["engines"][0]["status"] == "interrupted"


def test_sigterm_stops_the_launched_server_and_writes_what_finished(tmp_path: Path) -> None:
    """`timeout` or a cancelled CI job sends SIGTERM: handled as Ctrl-C, so the server goes too."""
    port = free_port()
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "max_tokens": 2}] * 40)
    launch = " ".join(stub_command("--ttft", "0.2", "--itl", "0.001", port=port))
    process = subprocess.Popen(
        [*PAGODA, "bench", "--launch", launch, "--base-url", f"http://127.0.0.1:{port}", "--dataset", str(data)]
        + ["--warmup", "0", "--no-progress", "--output", str(tmp_path / "out")],
        stderr=subprocess.PIPE,
        text=True,
    )
    for line in process.stderr:  # type: ignore[union-attr]
        if "replay of" in line:  # the server answers and the run has started
            break
    time.sleep(0.7)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=40) == 130
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2)
    engine = read_results(tmp_path / "out")["engines"][0]
    assert engine["status"] == "interrupted" and 1 <= engine["levels"][0]["summary"]["completed"] < 40
