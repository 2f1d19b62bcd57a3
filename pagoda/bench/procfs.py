"""Reading Linux's /proc: the few fields the memory sampler and the launcher need."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")


@dataclass(frozen=True)
class ProcStat:
    pid: int
    state: str  # "R", "S", ..., "Z" for a zombie
    ppid: int
    pgrp: int


def read_stat(entry: Path) -> ProcStat | None:
    try:
        text = (entry / "stat").read_text()
        # "pid (comm) state ppid pgrp ..."; comm may contain spaces and parentheses.
        state, ppid, pgrp = text[text.rindex(")") + 2 :].split()[:3]
        return ProcStat(int(entry.name), state, int(ppid), int(pgrp))
    except (OSError, ValueError):
        return None


def processes(proc: Path = PROC) -> Iterator[ProcStat]:
    for entry in proc.iterdir():
        if entry.name.isdigit():
            stat = read_stat(entry)
            if stat is not None:
                yield stat
