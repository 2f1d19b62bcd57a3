"""Peak memory of a server while it runs, sampled by a background thread: the resident set of
its process and all descendants (from /proc), and GPU memory in use (from nvidia-smi)."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from pagoda.bench.procfs import PROC, processes

MIB = 1024 * 1024
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


@dataclass(frozen=True)
class MemoryPeak:
    rss_mib: float | None  # the server's process tree; None without /proc or a pid
    gpu_mib: float | None  # all GPUs, every process (nvidia-smi cannot see containers' pids)
    gpu_baseline_mib: float | None  # GPU memory in use at the first sample, for comparison


def tree_rss_bytes(root: int, proc: Path = PROC) -> int | None:
    """Resident bytes of `root` and its descendants; None when `root` is gone or there is no /proc."""
    if not (proc / str(root)).is_dir():
        return None
    children: dict[int, list[int]] = {}
    for stat in processes(proc):
        children.setdefault(stat.ppid, []).append(stat.pid)
    total, stack = 0, [root]
    while stack:
        pid = stack.pop()
        total += _rss_bytes(proc / str(pid))
        stack.extend(children.get(pid, []))
    return total


def _rss_bytes(entry: Path) -> int:
    try:
        return int((entry / "statm").read_text().split()[1]) * PAGE_SIZE
    except (OSError, IndexError, ValueError):
        return 0


def gpu_used_mib() -> float | None:
    """Memory in use summed over every GPU, or None without a working nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout
        return float(sum(float(line) for line in out.split()))
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


class MemorySampler:
    """Samples while inside the `with` block; `peak()` is meaningful after it."""

    def __init__(self, pid: int | None, interval_s: float = 0.5) -> None:
        self._pid = pid
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pagoda-bench-memory", daemon=True)
        self._rss: int | None = None
        self._gpu: float | None = None
        self._gpu_baseline: float | None = None
        self._gpu_working = True

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while True:
            self._sample()
            if self._stop.wait(self._interval_s):
                return

    def _sample(self) -> None:
        if self._pid is not None:
            rss = tree_rss_bytes(self._pid)
            if rss is not None:
                self._rss = max(rss, self._rss or 0)
        if self._gpu_working:
            gpu = gpu_used_mib()
            self._gpu_working = gpu is not None
            if gpu is not None:
                self._gpu_baseline = gpu if self._gpu_baseline is None else self._gpu_baseline
                self._gpu = max(gpu, self._gpu or 0.0)

    def peak(self) -> MemoryPeak:
        return MemoryPeak(None if self._rss is None else self._rss / MIB, self._gpu, self._gpu_baseline)
