"""`pagoda serve`'s start-up, each test with a server process of its own on a tiny model: the
port is bound before the model loads (a busy port fails at once), 503s with Retry-After while it
loads, progress in the log, and a load that fails ends the process with one line and exit 1."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from pagoda.engine.args import DETERMINISTIC_BY_DEFAULT
from tests.server.helpers import free_port
from tests.tiny_models import write_tiny_model

pytestmark = pytest.mark.slow

EXIT_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    from pagoda.model_files import load_tokenizer

    return str(write_tiny_model("llama", tmp_path_factory.mktemp("tiny") / "llama", load_tokenizer(None)))


def start(port: int, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    command = [sys.executable, "-m", "pagoda.entrypoints.cli", "serve", "--port", str(port), *args]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def poll(url: str, until_status: int, timeout_s: float = EXIT_TIMEOUT_S) -> list[httpx.Response]:
    """Every answer from GET `url` until one has `until_status` (connection errors skipped)."""
    answers: list[httpx.Response] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            answers.append(httpx.get(url, timeout=5))
        except httpx.TransportError:
            pass
        if answers and answers[-1].status_code == until_status:
            return answers
        time.sleep(0.05)
    pytest.fail(f"GET {url} never answered {until_status}")


def assert_loading_503(response: httpx.Response) -> None:
    assert response.status_code == 503 and response.headers["Retry-After"] == "1"
    assert response.json()["error"] == {
        "message": "The model is still loading; retry shortly.",
        "type": "server_error",
        "param": None,
        "code": "model_loading",
    }


def test_a_busy_port_fails_at_once_with_one_line_and_exit_1(tiny_model):
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        process = start(port, tiny_model)
        _, stderr = process.communicate(timeout=EXIT_TIMEOUT_S)
    assert process.returncode == 1
    assert stderr.strip().splitlines() == [
        f"pagoda serve: cannot listen on 127.0.0.1:{port}: Address already in use (is another server running on it?)"
    ]


def test_bad_thread_settings_fail_before_the_port_with_one_line_and_exit_1(tiny_model):
    process = start(free_port(), tiny_model, "--threads", "0")
    _, stderr = process.communicate(timeout=EXIT_TIMEOUT_S)
    assert process.returncode == 1
    assert stderr.strip().splitlines() == ["pagoda serve: --threads must be at least 1 thread, got 0"]


def test_503_while_loading_then_the_api_and_progress_in_the_log(tiny_model, tmp_path):
    port = free_port()
    (tmp_path / "generation_config.json").write_text('{"max_new_tokens": 3}')
    flags = (
        "--access-log",
        "--kv-cache-memory",
        "0.01",
        "--root-path",
        "/pagoda",
        "--metrics-prefix",
        "vllm",
        "--generation-config",
        str(tmp_path),
    )
    process = start(port, tiny_model, *flags)
    try:
        answers = poll(f"http://127.0.0.1:{port}/v1/models", 200)
        assert answers[0].status_code == 503  # the port answered before the model had loaded
        for response in answers[:-1]:
            assert_loading_503(response)
        assert answers[-1].json()["data"][0]["id"] == "llama"
        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
        # --root-path: a path a proxy left its prefix on finds its route too (vLLM's rule)
        assert httpx.get(f"http://127.0.0.1:{port}/pagoda/health").status_code == 200
        assert httpx.get(f"http://127.0.0.1:{port}/pagoda/v1/models").json()["data"][0]["id"] == "llama"
        # the model as given is its name too (vLLM's id), and generation_config's max_new_tokens
        # is the default max_tokens of a chat request (as vLLM takes it)
        ask = {"model": tiny_model, "messages": [{"role": "user", "content": "Hi"}], "ignore_eos": True}
        chat = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=ask, timeout=60).json()
        assert chat["usage"]["completion_tokens"] == 3, chat
        # under vLLM's metric names, vLLM's model_name: the MODEL argument as given
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        assert f'vllm:generation_tokens_total{{model_name="{tiny_model}"}} 3.0' in metrics
    finally:
        process.send_signal(signal.SIGTERM)
        _, log = process.communicate(timeout=EXIT_TIMEOUT_S)
    assert process.returncode == 0
    steps = ["Reading the model config", "Loading the tokenizer", "Reading weights: file 1 of 1"]
    steps += ["Allocating the KV cache", "loaded llama", "ready: serving llama", "listening on this machine only"]
    positions = [log.index(step) for step in steps]
    assert positions == sorted(positions), log
    # --access-log: each request at the path it came with
    assert '"GET /v1/models HTTP/1.1" 200' in log and '"GET /pagoda/v1/models HTTP/1.1" 200' in log
    assert f"deterministic {'on' if DETERMINISTIC_BY_DEFAULT else 'off'})" in log  # the mode, in the load line


def test_a_log_config_file_is_the_logging_uvicorns_loggers_included(tiny_model, tmp_path):
    """--log-config-file (vLLM's): its dictConfig replaces the default handler and format."""
    written = tmp_path / "server.log"
    config = {
        "version": 1,
        "formatters": {"mine": {"format": "MINE %(levelname)s %(name)s: %(message)s"}},
        "handlers": {"file": {"class": "logging.FileHandler", "filename": str(written), "formatter": "mine"}},
        "loggers": {name: {"handlers": ["file"], "level": "INFO"} for name in ("pagoda", "uvicorn.access")},
    }
    (tmp_path / "logging.json").write_text(json.dumps(config))
    port = free_port()
    flags = ("--kv-cache-memory", "0.01", "--access-log", "--log-config-file", str(tmp_path / "logging.json"))
    process = start(port, tiny_model, *flags)
    try:
        poll(f"http://127.0.0.1:{port}/health", 200)
        deadline = time.monotonic() + EXIT_TIMEOUT_S
        while "ready: serving" not in written.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=EXIT_TIMEOUT_S)
    assert process.returncode == 0
    lines = written.read_text()
    assert "MINE INFO pagoda.serve: ready: serving llama" in lines
    assert '"GET /health HTTP/1.1" 200' in lines  # uvicorn's access log through the file's handler
    assert "ready: serving" not in stderr  # the default handler is not installed


@pytest.mark.parametrize(
    ("content", "why"),
    [(None, "No such file"), ("{", "Expecting property name"), ("{}", "dictionary doesn't specify a version")],
)
@pytest.mark.parametrize("by_variable", [False, True])
def test_a_log_config_that_cannot_be_applied_ends_the_process_with_one_line_and_exit_1(
    tiny_model, tmp_path, content, why, by_variable
):
    path = tmp_path / "logging.json"
    if content is not None:
        path.write_text(content)
    if by_variable:  # vLLM's variable for the same file
        process = start(free_port(), tiny_model, env={"VLLM_LOGGING_CONFIG_PATH": str(path)})
    else:
        process = start(free_port(), tiny_model, "--log-config-file", str(path))
    _, stderr = process.communicate(timeout=EXIT_TIMEOUT_S)
    assert process.returncode == 1
    [line] = stderr.strip().splitlines()
    assert line.startswith(f"pagoda serve: --log-config-file {path}: ") and why in line, line


def test_a_load_failure_ends_the_process_with_one_line_and_exit_1(tiny_model):
    port = free_port()
    process = start(port, tiny_model, "--kv-cache-memory", "0.000001")
    answers = poll(f"http://127.0.0.1:{port}/health", 503)
    assert_loading_503(answers[-1])
    _, log = process.communicate(timeout=EXIT_TIMEOUT_S)
    assert process.returncode == 1
    [line] = [line for line in log.splitlines() if line.startswith("pagoda serve:")]
    assert "cannot hold one sequence of max_model_len" in line
    assert "Traceback" not in log


def test_device_cuda_without_a_gpu_fails_with_one_line_and_exit_1(tiny_model):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    process = start(free_port(), tiny_model, "--device", "cuda")
    _, log = process.communicate(timeout=EXIT_TIMEOUT_S)
    assert process.returncode == 1
    [line] = [line for line in log.splitlines() if line.startswith("pagoda serve:")]
    assert line.startswith("pagoda serve: --device cuda cannot be used: ")
    assert "Traceback" not in log


def test_deterministic_refused_in_bfloat16_with_one_line_and_exit_1(tiny_model):
    process = start(free_port(), tiny_model, "--deterministic", "--dtype", "bfloat16")
    _, log = process.communicate(timeout=EXIT_TIMEOUT_S)
    assert process.returncode == 1
    [line] = [line for line in log.splitlines() if line.startswith("pagoda serve:")]
    assert line.startswith("pagoda serve: --deterministic cannot hold here: ") and "float32 only" in line
    assert "Traceback" not in log


def test_sigterm_while_loading_exits_promptly(tiny_model):
    port = free_port()
    process = start(port, tiny_model)
    poll(f"http://127.0.0.1:{port}/health", 503)
    process.send_signal(signal.SIGTERM)
    process.communicate(timeout=EXIT_TIMEOUT_S)
    assert process.returncode == 0
