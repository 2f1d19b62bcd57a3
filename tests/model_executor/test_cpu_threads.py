"""The compute pool: its size from flags and environment, pinning, and shrinking while other
processes keep CPUs busy."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from pagoda.config import ThreadConfig, parse_cores
from pagoda.engine.args import EngineArgs
from pagoda.errors import ConfigError
from pagoda.kernels import cpu as cpu_kernels
from pagoda.model_executor import cpu_threads
from pagoda.model_executor.cpu_threads import ComputeThreads, LoadWatch


@pytest.fixture(autouse=True)
def restore_torch_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_parse_cores():
    assert parse_cores("0-3,6") == (0, 1, 2, 3, 6)
    assert parse_cores("1") == (1,)
    for bad in ("a", "1-", "0,0", "3-x", "", "1-0"):
        with pytest.raises(ValueError):
            parse_cores(bad)


def test_thread_count_precedence(monkeypatch):
    monkeypatch.delenv("PAGODA_NUM_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert EngineArgs().thread_config() == ThreadConfig(None, None)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert EngineArgs().thread_config().num_threads == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "3,1")  # OpenMP's nested levels: the first is a step's
    assert EngineArgs().thread_config().num_threads == 3
    monkeypatch.setenv("PAGODA_NUM_THREADS", "2")
    assert EngineArgs().thread_config().num_threads == 2
    assert EngineArgs(threads=1).thread_config().num_threads == 1


@pytest.mark.parametrize(
    "args,env,message",
    [
        ({"threads": 0}, {}, "--threads must be at least 1"),
        ({}, {"PAGODA_NUM_THREADS": "0"}, r"\$PAGODA_NUM_THREADS must be at least 1"),
        ({}, {"PAGODA_NUM_THREADS": "many"}, "PAGODA_NUM_THREADS"),
        ({"bind_cores": "0-"}, {}, "--bind-cores"),
        ({"bind_cores": "1-0"}, {}, "--bind-cores: '1-0': the range 1-0 runs backwards"),
        ({"bind_cores": "100000"}, {}, "may only run on CPUs"),
        ({"bind_cores": "0", "threads": 2}, {}, "--threads 2: .* cannot be pinned to the 1 CPUs of --bind-cores 0"),
        ({"bind_cores": "0"}, {"OMP_NUM_THREADS": "2"}, r"\$OMP_NUM_THREADS 2: .* --bind-cores 0"),
    ],
)
def test_bad_thread_settings_are_config_errors(monkeypatch, args, env, message):
    monkeypatch.delenv("PAGODA_NUM_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    with pytest.raises(ConfigError, match=message):
        EngineArgs(**args).thread_config()


def test_fixed_count_is_set_and_never_adjusted():
    threads = ComputeThreads(ThreadConfig(num_threads=1))
    assert torch.get_num_threads() == 1 and threads.watch is None
    threads.adjust()
    assert torch.get_num_threads() == 1


def test_more_threads_than_cpus_are_warned_of(caplog):
    cpus = len(os.sched_getaffinity(0))
    try:
        with caplog.at_level(logging.WARNING, "pagoda.model_executor.cpu_threads"):
            ComputeThreads(ThreadConfig(num_threads=cpus + 3))
        assert f"{cpus + 3} compute threads on {cpus} CPUs" in caplog.text
        caplog.clear()
        with caplog.at_level(logging.WARNING, "pagoda.model_executor.cpu_threads"):
            ComputeThreads(ThreadConfig(num_threads=cpus))
        assert caplog.text == ""
    finally:
        torch.set_num_threads(cpus)


class FakeWatch:
    def __init__(self, readings):
        self.readings = list(readings)

    def poll(self):
        return self.readings.pop(0)


@pytest.mark.parametrize(
    "busy_elsewhere,expected",
    [(None, 4), (0.2, 4), (0.7, 3), (1.4, 3), (2.6, 1), (7.0, 1)],
)
def test_auto_pool_keeps_the_cpus_others_leave_free(monkeypatch, busy_elsewhere, expected):
    threads = ComputeThreads(ThreadConfig())
    threads.cpus, threads.max_threads, threads.num_threads = [0, 1, 2, 3], 4, 4
    torch.set_num_threads(4)
    threads.watch = FakeWatch([busy_elsewhere])
    threads.adjust()
    assert threads.num_threads == torch.get_num_threads() == expected


def cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def spin(seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        pass


def test_load_watch_counts_a_busy_process_and_not_its_own_work(monkeypatch):
    """What the watch reports covers at least most of a busy process's use, and this process's
    own spinning is not part of it (on a shared machine others' load adds to both readings)."""
    monkeypatch.setattr(cpu_threads, "CHECK_INTERVAL_S", 0.5)
    watch = LoadWatch(sorted(os.sched_getaffinity(0)))
    assert watch.poll() is None  # too soon
    own_start = os.times()
    spin(1.0)  # this process busy
    elsewhere_while_spinning = watch.poll()
    own_share = sum(os.times()[:2]) - sum(own_start[:2])
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        spin(0.5)
        watch.poll()  # the interval the hog's start straddled
        hog_start = cpu_seconds(busy.pid)
        spin(1.0)  # this process at work meanwhile, as an engine's steps are
        elsewhere = watch.poll()
        hog_share = cpu_seconds(busy.pid) - hog_start
    finally:
        busy.kill()
        busy.wait()
    assert elsewhere is not None and elsewhere_while_spinning is not None
    assert elsewhere >= 0.7 * hog_share > 0, (elsewhere, hog_share)
    total = len(os.sched_getaffinity(0))
    assert elsewhere_while_spinning <= total - 0.7 * own_share, (elsewhere_while_spinning, own_share)


def test_load_watch_gives_no_verdict_on_an_interval_this_process_idled(monkeypatch):
    """A busy process seen while the engine waited (as a benchmark client starting up before its
    requests) does not shrink the team for the steps that follow: that poll gives nothing, and
    the next interval, spent at work, is the one judged."""
    monkeypatch.setattr(cpu_threads, "CHECK_INTERVAL_S", 0.5)
    watch = LoadWatch(sorted(os.sched_getaffinity(0)))
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.8)  # idle while the other process runs
        assert watch.poll() is None
        spin(0.8)
        assert watch.poll() is not None  # at work: judged again
    finally:
        busy.kill()
        busy.wait()


@pytest.mark.skipif(cpu_kernels.load() is None, reason="the C kernels cannot be built on this machine")
def test_binding_pins_the_compute_threads():
    """On a thread of its own (whose pool is its own), pinned to the first allowed CPU: every
    thread that then runs a torch parallel region runs there."""
    cpu = min(os.sched_getaffinity(0))
    seen: list[set[int]] = []

    def run() -> None:
        ComputeThreads(ThreadConfig(num_threads=1, bind_cores=(cpu,)))
        seen.append(os.sched_getaffinity(0))

    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    assert seen == [{cpu}]


@pytest.mark.skipif(cpu_kernels.load() is None, reason="the C kernels cannot be built on this machine")
def test_binding_log_names_only_the_cpus_pinned(caplog):
    """One thread over a list of two CPUs is pinned to the first: the log says so, not both."""
    cpus = tuple(sorted(os.sched_getaffinity(0)))[:2]
    if len(cpus) < 2:
        pytest.skip("needs two CPUs")
    worker = threading.Thread(target=lambda: ComputeThreads(ThreadConfig(num_threads=1, bind_cores=cpus)))
    with caplog.at_level(logging.INFO, "pagoda.model_executor.cpu_threads"):
        worker.start()
        worker.join()
    assert f"pinned to CPUs [{cpus[0]}]" in caplog.text
