"""Launching and stopping servers as process groups, and sampling their memory."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from pagoda.bench.errors import BenchError
from pagoda.bench.launcher import SERVER_NICENESS, LaunchSpec, launched, missing_executable, parse_command
from pagoda.bench.memory import MemorySampler, tree_rss_bytes
from pagoda.bench.procfs import processes


def group_alive(group: int) -> bool:
    return any(p.pgrp == group and p.state != "Z" for p in processes())


def test_stop_kills_a_group_that_ignores_sigterm(tmp_path: Path) -> None:
    # A shell that ignores SIGTERM with a child that inherits it: only SIGKILL ends them.
    command = ("bash", "-c", "trap '' TERM; sleep 60 & echo started; wait")
    spec = LaunchSpec(command, tmp_path / "log", stop_timeout_s=0.5)
    began = time.monotonic()
    with launched(spec) as process:
        while "started" not in spec.log_path.read_text():
            time.sleep(0.05)
        assert group_alive(process.pid)
        assert len([p for p in processes() if p.pgrp == process.pid]) == 2
    assert not group_alive(process.pid)
    assert 0.5 <= time.monotonic() - began < 10


def test_stop_is_quick_for_a_well_behaved_group(tmp_path: Path) -> None:
    with launched(LaunchSpec(("sleep", "60"), tmp_path / "log")) as process:
        pass
    assert process.returncode is not None and not group_alive(process.pid)


def test_the_server_and_its_children_run_behind_the_client(tmp_path: Path) -> None:
    """The launched group runs at a higher nice value than the benchmark, children included, so
    that a server keeping every core busy does not delay the client's reads."""
    ours = os.getpriority(os.PRIO_PROCESS, 0)
    spec = LaunchSpec(("bash", "-c", "sleep 60 & echo started; wait"), tmp_path / "log")
    with launched(spec) as process:
        while "started" not in spec.log_path.read_text():
            time.sleep(0.05)
        members = [p.pid for p in processes() if p.pgrp == process.pid]
        assert len(members) == 2
        assert all(os.getpriority(os.PRIO_PROCESS, pid) == min(19, ours + SERVER_NICENESS) for pid in members)


def test_the_environment_reaches_the_server(tmp_path: Path) -> None:
    spec = LaunchSpec(("bash", "-c", "echo value=$BENCH_TEST_VAR"), tmp_path / "log", {"BENCH_TEST_VAR": "42"})
    with launched(spec) as process:
        process.wait(timeout=10)
    assert "value=42" in spec.log_path.read_text()


def test_missing_programs_are_named(tmp_path: Path) -> None:
    assert missing_executable(("no-such-program-xyz",)) == "no-such-program-xyz"
    assert missing_executable(("/nonexistent/bin/server",)) == "/nonexistent/bin/server"
    assert missing_executable(("sleep", "1")) is None
    with pytest.raises(BenchError, match="command not found: no-such-program-xyz"):
        with launched(LaunchSpec(("no-such-program-xyz",), tmp_path / "log")):
            pass


def test_parse_command() -> None:
    assert parse_command("vllm serve 'my model' --port 8000") == ("vllm", "serve", "my model", "--port", "8000")
    for bad in ("", "unterminated 'quote"):
        with pytest.raises(BenchError):
            parse_command(bad)


def test_memory_of_a_process_tree(tmp_path: Path) -> None:
    own = tree_rss_bytes(os.getpid())
    assert own is not None and own > 10 * 1024 * 1024
    with launched(LaunchSpec(("bash", "-c", "sleep 60 & sleep 60 & wait"), tmp_path / "log")) as process:
        time.sleep(0.3)
        with MemorySampler(process.pid, interval_s=0.05) as sampler:
            time.sleep(0.2)
        peak = sampler.peak()
        single = tree_rss_bytes(processes_sleep_pid(process.pid))
    assert peak.rss_mib is not None and single is not None
    assert peak.rss_mib * 1024 * 1024 > single  # bash and both sleeps, not one process
    assert tree_rss_bytes(process.pid) is None  # gone after the stop


def processes_sleep_pid(group: int) -> int:
    return next(p.pid for p in processes() if p.pgrp == group and p.pid != group)
