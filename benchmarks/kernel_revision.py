"""Another git revision's CPU kernels, built for this CPU as pagoda.kernels.cpu builds them and
loaded beside this checkout's: the baseline side of the kernel A/B benchmarks
(prefill_attention.py, gemm_invariant.py, quant_kernels.py --baseline), and the alternating timer
the first two share."""

from __future__ import annotations

import ctypes
import statistics
import subprocess
import tarfile
import time
from io import BytesIO
from pathlib import Path

import torch

from pagoda.kernels import cpu

ROOT = Path(__file__).resolve().parents[1]
CSRC = "pagoda/kernels/csrc"


def extract(rev: str, dest: Path) -> Path:
    """The tree of git revision `rev` (its tracked files), written under dest."""
    archive = subprocess.run(["git", "archive", rev], cwd=ROOT, capture_output=True, check=True).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(dest, filter="data")
    return dest


def build(csrc: Path, out: Path) -> ctypes.CDLL:
    """Every C file of csrc/ built as pagoda.kernels.cpu builds them, with the kernel signatures that
    exist in it set, and `isa` and `amx` as cpu.load() sets them (the tile registers are granted
    per process: asking again is harmless)."""
    isa = cpu.cpu_isa()
    error = cpu.build_library("gcc", cpu.compiler_flags(isa), list(csrc.glob("*.c")), out)
    if error is not None:
        raise RuntimeError(f"building {csrc} failed:\n{error}")
    lib = ctypes.CDLL(str(out))
    for name, argtypes in cpu._VOID_SIGNATURES.items():
        if hasattr(lib, name):
            getattr(lib, name).argtypes = argtypes
            getattr(lib, name).restype = None
    lib.isa = isa
    lib.pagoda_amx_enable.restype = ctypes.c_int
    lib.amx = "amx" in isa and lib.pagoda_amx_enable() == 1
    return lib


def revision_kernels(rev: str, tmp: Path) -> ctypes.CDLL:
    """Revision rev's kernels, its tree extracted and built under tmp."""
    return build(extract(rev, tmp / "tree") / CSRC, tmp / "kernels.so")


def median_time(fn, seconds: float) -> float:
    fn()
    times, start = [], time.perf_counter()
    while not times or time.perf_counter() - start < seconds:
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def compare(libs, run, rounds: int, seconds: float) -> dict:
    """run(lib) -> output, for the baseline's kernels and this checkout's: their outputs' largest
    difference (0: the same bits) and the median over alternating rounds of each side's median
    call time, in ms."""
    a, b = (run(lib) for lib in libs)
    differ = 0.0 if torch.equal(a, b) else (a - b).abs().max().item()
    times: list[list[float]] = [[], []]
    for _ in range(rounds):
        for i, lib in enumerate(libs):
            times[i].append(median_time(lambda lib=lib: run(lib), seconds))
    base, this = (statistics.median(t) * 1e3 for t in times)
    return {"base_ms": base, "this_ms": this, "differ": differ}
