"""The compute threads of a CPU engine: one pool for all parallel work, sized to the machine.

Torch's intra-op pool (OpenMP) runs the GEMMs and elementwise ops, and Pagoda's C kernels run on
the same OpenMP runtime, so there is one pool. libgomp keeps one pool per thread that starts
parallel regions, and once the process holds more pool threads than CPUs it stops spinning between
regions, and each region then waits on sleeping threads. So all compute of an engine runs on the one
thread that built it (AsyncEngine loads its core on its engine thread), and the size is set there.

Sizing: `threads` fixed, or auto: every CPU this process may run on, fewer while other processes
keep some of them busy. A fork-join step is as slow as its slowest thread, and a thread that shares
its core with a busy process gets half of it, so a team of two on two cores with one busy runs
slower than a team of one. `LoadWatch` measures the other processes' CPU use from /proc/stat
(minus this process's own time) about once a second, and the team shrinks to the CPUs left free.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

import torch

from pagoda.config import ThreadConfig
from pagoda.kernels import cpu as cpu_kernels

logger = logging.getLogger(__name__)

CHECK_INTERVAL_S = 1.0
# a poll whose interval this process spent mostly idle (under this share of one CPU) gives no
# verdict: what others ran while the engine waited (a client starting up, say) says little about
# the steps to come, and a persistent load shows again in the next interval, which the steps fill
IDLE_SHARE = 0.5


class ComputeThreads:
    """Sizes (and optionally pins) the calling thread's compute pool; `adjust()` before each step
    resizes an adaptive pool when the machine's other load has changed."""

    def __init__(self, config: ThreadConfig) -> None:
        self.owner = threading.get_ident()  # the thread whose pool this sizes; every step runs on it
        allowed = sorted(os.sched_getaffinity(0))
        self.cpus = list(config.bind_cores) if config.bind_cores else allowed
        self.max_threads = config.num_threads or len(self.cpus)
        if self.max_threads > len(self.cpus):
            logger.warning(
                "%d compute threads on %d CPUs: threads that share a core slow every step (each waits for the "
                "slowest); --threads %d or fewer is faster",
                self.max_threads,
                len(self.cpus),
                len(self.cpus),
            )
        self.watch = LoadWatch(self.cpus) if config.adaptive else None
        self.num_threads = self.max_threads
        torch.set_num_threads(self.num_threads)
        pinned = list(config.bind_cores[: self.num_threads]) if config.bind_cores else []  # thread i to pinned[i]
        if pinned and not self._bind(pinned):
            pinned = []
        logger.info(
            "compute threads: %d%s%s",
            self.num_threads,
            " (auto: fewer while other processes keep CPUs busy)" if self.watch else "",
            f", pinned to CPUs {pinned}" if pinned else "",
        )

    def _bind(self, cpus: list[int]) -> bool:
        lib = cpu_kernels.load()
        if lib is None or not cpu_kernels.bind_threads(lib, cpus):
            logger.warning("could not pin the compute threads to CPUs %s; they run unpinned", cpus)
            return False
        return True

    def adjust(self) -> None:
        if self.watch is None:
            return
        busy_elsewhere = self.watch.poll()
        if busy_elsewhere is None:
            return
        wanted = max(1, min(self.max_threads, len(self.cpus) - round(busy_elsewhere)))
        if wanted != self.num_threads:
            logger.info(
                "compute threads %d -> %d (other processes use %.1f CPUs)", self.num_threads, wanted, busy_elsewhere
            )
            self.num_threads = wanted
            torch.set_num_threads(wanted)


class LoadWatch:
    """How many of `cpus` other processes kept busy, from /proc/stat and this process's own CPU
    time, over the last interval of at least CHECK_INTERVAL_S."""

    def __init__(self, cpus: list[int]) -> None:
        self.cpus = {f"cpu{i}" for i in cpus}
        self.tick = os.sysconf("SC_CLK_TCK")
        self.last = self._sample()

    def _sample(self) -> tuple[float, float, float] | None:
        """(wall s, busy CPU s of `cpus`, this process's CPU s); None without /proc/stat."""
        try:
            lines = Path("/proc/stat").read_text().splitlines()
        except OSError:
            return None
        busy = 0
        for line in lines:
            name, *values = line.split()
            if name in self.cpus:
                counts = [int(v) for v in values]
                busy += sum(counts) - counts[3] - counts[4]  # all but idle and iowait
        own = os.times()
        return time.monotonic(), busy / self.tick, own.user + own.system

    def poll(self) -> float | None:
        """The CPUs other processes used since the last poll; None until CHECK_INTERVAL_S has
        passed, where this process was mostly idle meanwhile (IDLE_SHARE; a new interval starts),
        or where /proc/stat cannot be read."""
        if self.last is None or time.monotonic() - self.last[0] < CHECK_INTERVAL_S:
            return None
        now = self._sample()
        if now is None:
            return None
        wall, busy, own = (b - a for a, b in zip(self.last, now))
        self.last = now
        if own < IDLE_SHARE * wall:
            return None
        return max(0.0, (busy - own) / wall)
