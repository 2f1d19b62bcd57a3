"""Two real `pagoda serve` processes on free loopback ports, shared by the whole session.

- `server`: the default model with a small KV budget, an API key, a request log, tool_choice
  "auto" enabled and a --reports folder for the console; most tests.
- `small_server`: two sequences at a time and a waiting queue of one (so 503 is reachable), prompt
  text in its log lines, a short shutdown grace (SMALL_GRACE_S), a --tool-call-parser its template
  cannot use, --reasoning-parser qwen3, vLLM's Responses store (VLLM_ENABLE_RESPONSES_API_STORE);
  the SIGTERM test ends it, so it runs last.
Both are launched together on first use (their model loads overlap) and killed at the end.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.server.helpers import API_KEY, SMALL_GRACE_S, free_port

STARTUP_TIMEOUT_S = 300


@dataclass
class Server:
    process: subprocess.Popen
    base_url: str
    log_path: Path
    request_log: Path | None = None
    api_key: str | None = None
    reports: Path | None = None

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_healthy(self) -> Server:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                pytest.fail(f"the server exited with code {self.process.returncode}:\n{self.log()[-3000:]}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        pytest.fail(f"the server was not healthy within {STARTUP_TIMEOUT_S} s:\n{self.log()[-3000:]}")


def _launch(
    folder: Path,
    name: str,
    *args: str,
    api_key: str | None = None,
    request_log: Path | None = None,
    reports: Path | None = None,
    env: dict[str, str] | None = None,
) -> Server:
    port = free_port()
    log_path = folder / f"{name}.log"
    command = [
        sys.executable,
        "-m",
        "pagoda.entrypoints.cli",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *args,
    ]
    if api_key:
        command += ["--api-key", api_key]
    if request_log:
        command += ["--request-log", str(request_log)]
    if reports:
        reports.mkdir()
        command += ["--reports", str(reports)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    env.pop("PAGODA_API_KEY", None)
    with log_path.open("w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return Server(process, f"http://127.0.0.1:{port}", log_path, request_log, api_key, reports)


@pytest.fixture(scope="session")
def _launched(tmp_path_factory) -> Iterator[dict[str, Server]]:
    folder = tmp_path_factory.mktemp("servers")
    servers = {
        "main": _launch(
            folder,
            "main",
            "--kv-cache-memory",
            "0.5",
            "--max-model-len",
            "2048",
            "--enable-auto-tool-choice",
            *("--allowed-origins", '["http://app.example"]'),
            api_key=API_KEY,
            request_log=folder / "requests.jsonl",
            reports=folder / "reports",
        ),
        "small": _launch(
            folder,
            "small",
            "--kv-cache-memory",
            "0.15",
            "--max-model-len",
            "2048",
            "--max-num-seqs",
            "2",
            "--max-queue",
            "1",
            "--log-prompts",
            *("--max-log-len", "30"),
            "--disable-fastapi-docs",
            *("--tool-call-parser", "hermes"),  # unused: the default model's template shows no tools
            *("--reasoning-parser", "qwen3"),
            "--trust-request-chat-template",
            "--exclude-tools-when-tool-choice-none",
            "--shutdown-timeout",
            str(SMALL_GRACE_S),
            env={"VLLM_ENABLE_RESPONSES_API_STORE": "1"},  # vLLM's: the Responses API keeps its responses
        ),
    }
    yield servers
    for server in servers.values():
        if server.process.poll() is None:
            os.killpg(server.process.pid, signal.SIGKILL)
            server.process.wait(timeout=30)


@pytest.fixture(scope="session")
def server(_launched) -> Server:
    return _launched["main"].wait_healthy()


@pytest.fixture(scope="session")
def small_server(_launched) -> Server:
    return _launched["small"].wait_healthy()


@pytest.fixture(scope="session")
def client(server):
    import openai

    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture
def aclient(server):
    """A factory: each async test opens (`async with`) and closes its client inside its own loop."""
    import openai

    return lambda: openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def http(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, headers=server.headers, timeout=120) as client:
        yield client
