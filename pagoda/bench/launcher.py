"""Starting a server for a measurement and stopping it, whatever happens in between.

The server runs in its own session, so its process group holds it and every helper it starts
(vLLM's engine core, a shell's children), and Ctrl-C in the terminal reaches only the
benchmark, which then stops the group: SIGTERM, a grace period, then SIGKILL. A SIGTERM sent to
the benchmark itself is taken as a Ctrl-C.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from pagoda.bench.errors import BenchError
from pagoda.bench.procfs import PROC, processes

POLL_S = 0.25
# How far the launched server's nice value is above the client's. On a machine the two share, a
# server that keeps every core busy otherwise delays the client's reads and sends: on 2 cores the
# client's closed loop then sent requests that had ended close together at once, the server ran
# them together, and a shared-prefix run's TTFT p50 read 409-521 ms where the same server measured
# 109-118 ms with the client ahead of it (docs/bench.md).
SERVER_NICENESS = 10
LOG_TAIL_LINES = 15
KILL_GRACE_S = 5.0  # how long stop() waits for SIGKILLed members to disappear


@dataclass(frozen=True)
class LaunchSpec:
    command: tuple[str, ...]
    log_path: Path
    env: Mapping[str, str] = field(default_factory=dict)  # added to this process's environment
    ready_timeout_s: float = 600.0
    stop_timeout_s: float = 30.0


def parse_command(text: str) -> tuple[str, ...]:
    try:
        command = tuple(shlex.split(text))
    except ValueError as exc:
        raise BenchError(f"cannot parse launch command {text!r}: {exc}") from None
    if not command:
        raise BenchError("the launch command is empty")
    return command


def missing_executable(command: tuple[str, ...]) -> str | None:
    """The command's program when it cannot be run, else None."""
    program = command[0]
    if os.sep in program:
        return None if os.access(program, os.X_OK) and Path(program).is_file() else program
    return None if shutil.which(program) else program


@contextmanager
def launched(spec: LaunchSpec) -> Iterator[subprocess.Popen[bytes]]:
    """The running server; stopped when the block exits, normally or not."""
    program = missing_executable(spec.command)
    if program is not None:
        raise BenchError(f"cannot launch the server: command not found: {program}")
    spec.log_path.parent.mkdir(parents=True, exist_ok=True)
    with spec.log_path.open("ab") as log:
        try:
            # `nice` raises the value before the server runs: set from here after the start, a
            # child the server forked at once (a shell's first command) kept the client's value
            process = subprocess.Popen(
                ("nice", "-n", str(SERVER_NICENESS), *spec.command),
                env={**os.environ, **spec.env},
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        except OSError as exc:
            raise BenchError(f"cannot launch {shlex.join(spec.command)}: {exc}") from None
        try:
            with _terminate_as_interrupt():
                yield process
        finally:
            stop(process, spec.stop_timeout_s)


@contextmanager
def _terminate_as_interrupt() -> Iterator[None]:
    """While a launched server runs, SIGTERM (`timeout`, `kill`, a CI job cancelled) ends the run as
    Ctrl-C does: the requests that finished are written and the server's group is stopped, where
    the default action would end this process at once and leave the server running. (Signal
    handlers can only be set from the main thread; elsewhere SIGTERM keeps its action.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def stop(process: subprocess.Popen[bytes], timeout_s: float) -> None:
    """Stop the process group: SIGTERM, wait up to `timeout_s`, then SIGKILL."""
    group = process.pid  # start_new_session made the server its group's leader
    _signal_group(group, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pass
    _wait_group_gone(group, deadline, 0.1)
    if _group_alive(group):
        _signal_group(group, signal.SIGKILL)
    process.wait()
    # SIGKILL is delivered asynchronously: on a busy machine the group's other members can
    # still show as running for a moment, and callers rely on the group being gone.
    _wait_group_gone(group, time.monotonic() + KILL_GRACE_S, 0.02)


def _wait_group_gone(group: int, deadline: float, poll_s: float) -> None:
    """Polls until no process of the group runs or time.monotonic() reaches `deadline`."""
    while _group_alive(group) and time.monotonic() < deadline:
        time.sleep(poll_s)


def _signal_group(group: int, signum: int) -> None:
    try:
        os.killpg(group, signum)
    except (ProcessLookupError, PermissionError):
        pass


def _group_alive(group: int) -> bool:
    """Whether a process of the group still runs (zombies, already dead, do not count)."""
    if PROC.is_dir():
        return any(p.pgrp == group and p.state != "Z" for p in processes())
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True


def check_port_free(base_url: str) -> None:
    """Refuse to launch a server at `base_url` while something already listens there: the launched
    one could not take the port, and the run would measure the other one."""
    url = httpx.URL(base_url)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.host, port), timeout=1.0):
            pass
    except OSError:
        return  # nothing answers: the port is the launched server's to take
    raise BenchError(
        f"something already listens at {url.host}:{port}; stop it or give the launched server another port "
        "(and --base-url with it)"
    )


def wait_until_ready(process: subprocess.Popen[bytes], spec: LaunchSpec, base_url: str, started_at: float) -> float:
    """Seconds from `started_at` (time.perf_counter) until GET /v1/models answers 200."""
    deadline = started_at + spec.ready_timeout_s
    with httpx.Client(timeout=5.0, trust_env=False) as http:
        while True:
            code = process.poll()
            if code is not None:
                raise BenchError(f"the server exited with code {code} before it answered.{_log_tail(spec.log_path)}")
            try:
                if http.get(f"{base_url}/v1/models").status_code == 200:
                    return time.perf_counter() - started_at
            except httpx.HTTPError:
                pass
            if time.perf_counter() > deadline:
                raise BenchError(
                    f"the server did not answer GET {base_url}/v1/models within {spec.ready_timeout_s:g} s."
                    f"{_log_tail(spec.log_path)}"
                )
            time.sleep(POLL_S)


def _log_tail(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
    except OSError:
        return ""
    return f"\nLast lines of {path}:\n" + "\n".join(f"  {line}" for line in lines) if lines else f" ({path} is empty)"
