"""The compute pool: its size from flags and environment, pinning, and shrinking while other
processes keep CPUs busy."""

from __future__ import annotations

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
    for bad in ("a", "1-", "0,0", "3-x", ""):
        with pytest.raises(ValueError):
            parse_cores(bad)


def test_thread_count_precedence(monkeypatch):
    monkeypatch.delenv("PAGODA_NUM_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert EngineArgs().thread_config() == ThreadConfig(None, None)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert EngineArgs().thread_config().num_threads == 3
    monkeypatch.setenv("PAGODA_NUM_THREADS", "2")
    assert EngineArgs().thread_config().num_threads == 2
    assert EngineArgs(threads=1).thread_config().num_threads == 1


@pytest.mark.parametrize(
    "args,env,message",
    [
        ({"threads": 0}, {}, "at least 1"),
        ({}, {"PAGODA_NUM_THREADS": "many"}, "PAGODA_NUM_THREADS"),
        ({"bind_cores": "0-"}, {}, "--bind-cores"),
        ({"bind_cores": "100000"}, {}, "may only run on CPUs"),
        ({"bind_cores": "0", "threads": 2}, {}, "cannot be pinned to 1 CPUs"),
    ],
)
def test_bad_thread_settings_are_config_errors(monkeypatch, args, env, message):
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    with pytest.raises(ConfigError, match=message):
        EngineArgs(**args).thread_config()


def test_fixed_count_is_set_and_never_adjusted():
    threads = ComputeThreads(ThreadConfig(num_threads=1))
    assert torch.get_num_threads() == 1 and threads.watch is None
    threads.adjust()
    assert torch.get_num_threads() == 1


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


def test_load_watch_sees_a_busy_process_and_not_its_own_work(monkeypatch):
    monkeypatch.setattr(cpu_threads, "CHECK_INTERVAL_S", 0.5)
    cpus = sorted(os.sched_getaffinity(0))
    watch = LoadWatch(cpus)
    assert watch.poll() is None  # too soon
    deadline = time.monotonic() + 0.6
    while time.monotonic() < deadline:  # this process's own busy time is not "elsewhere"
        pass
    own = watch.poll()
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(1.0)
        watch.poll()  # from the last poll, which the busy process's start straddled
        time.sleep(1.0)
        elsewhere = watch.poll()
    finally:
        busy.kill()
        busy.wait()
    assert own is not None and elsewhere is not None
    assert elsewhere - own > 0.5, (own, elsewhere)  # one busy process: about one CPU more than before


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
