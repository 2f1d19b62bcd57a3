"""What this machine allows, measured with the threads the engine would use: the CPU's kind and
flags, memory read bandwidth, single-row GEMV read rates (Pagoda's C kernel and torch's), GEMM
rates in fp32 (torch's matmul, oneDNN on a packed weight as vLLM-CPU runs it, and Pagoda's own
batch-invariant GEMM, as the engine runs its linears) and bf16, and the cores' float32 FMA peak
(fma_peak.c, a copy per thread at once: multiply-adds alone, no memory); and from them the default
model's fp32 decode floor (its weight bytes over the GEMV read rate) and the fp32 compute ceiling
of a 256-in/64-out workload (each output token carries five tokens of compute: (256 + 64) / 64),
from the fastest fp32 GEMM rate.

    python benchmarks/machine_limits.py [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from pagoda.kernels import cpu as cpu_kernels

GFLOP_PER_TOKEN = 0.27  # SmolLM2-135M: 2 x 135M parameters
DEFAULT_MODEL_FP32_BYTES = 540e6  # its weights in fp32, the tied embedding read once as the LM head
REPEATS = 7


def best_of(fn, repeats: int = REPEATS) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]  # the median


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def gemm_rate(dtype: torch.dtype) -> float:
    """GFLOP/s of torch's square matmul at 2,048, or at the first size from 512 up whose call takes
    over 50 ms: without AVX512-BF16 a bf16 GEMM runs at well under 1 GFLOP/s, and 2,048 would take
    a minute a call."""
    n = 512
    while True:
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        seconds = best_of(lambda a=a, b=b: a @ b)
        if n >= 2048 or seconds > 0.05:
            return 2 * n**3 / seconds / 1e9
        n *= 2


def fma_peak_rate(copies: int) -> float | None:
    """GFLOP/s of fma_peak.c (one core's peak), `copies` of it run at once and summed: the
    machine's float32 FMA peak on that many cores (None without a C compiler)."""
    with tempfile.TemporaryDirectory() as tmp:
        program = Path(tmp) / "fma_peak"
        source = Path(__file__).with_name("fma_peak.c")
        if subprocess.run(["gcc", "-O2", "-march=native", str(source), "-o", str(program)]).returncode != 0:
            return None
        runs = [subprocess.Popen([str(program)], stdout=subprocess.PIPE, text=True) for _ in range(copies)]
        return sum(float(run.communicate()[0].split()[0]) for run in runs)  # "N GFLOP/s on one core .."


def measure() -> dict:
    lib = cpu_kernels.load()
    weight = torch.randn(4 * 49152, 576)  # 453 MB: far past every cache
    x = torch.randn(1, 576)
    nbytes = weight.numel() * 4
    result: dict = {
        "cpu": cpu_model(),
        "threads": torch.get_num_threads(),
        "isa_flags": sorted(
            f for f in cpu_kernels.cpu_flags() if f.startswith(("avx", "amx", "fma", "f16c")) or f == "sse4_2"
        ),
        "kernels_built_for": list(lib.isa) if lib is not None else None,
        "read_GBps": nbytes / best_of(lambda: weight.sum()) / 1e9,
        "gemv_torch_GBps": nbytes / best_of(lambda: torch.mv(weight, x[0])) / 1e9,
    }
    if lib is not None:
        result["gemv_pagoda_GBps"] = nbytes / best_of(lambda: cpu_kernels.gemv(lib, x, weight, None)) / 1e9
    for dtype in (torch.float32, torch.bfloat16):
        result[f"gemm_{str(dtype).removeprefix('torch.')}_GFLOPs"] = gemm_rate(dtype)
    # at a prefill chunk's shape (gate_up, 1024 rows): oneDNN on a packed weight, and Pagoda's GEMM
    weight, rows = torch.randn(3072, 576), torch.randn(1024, 576)
    flops = 2 * 1024 * 576 * 3072
    packed = torch.ops.mkldnn._reorder_linear_weight(weight)
    seconds = best_of(lambda: torch.ops.mkldnn._linear_pointwise(rows, packed, None, "none", [], ""))
    result["gemm_float32_onednn_packed_GFLOPs"] = flops / seconds / 1e9
    if lib is not None:
        panels = cpu_kernels.pack_panels(lib, weight)
        seconds = best_of(lambda: cpu_kernels.gemm_invariant(lib, rows, panels, None, 3072))
        result["gemm_float32_pagoda_GFLOPs"] = flops / seconds / 1e9
    result["fma_peak_float32_GFLOPs"] = fma_peak_rate(torch.get_num_threads())
    gemv = result.get("gemv_pagoda_GBps", result["gemv_torch_GBps"])
    result["default_model_fp32_decode_floor_ms"] = DEFAULT_MODEL_FP32_BYTES / (gemv * 1e9) * 1e3
    gemm = max(v for k, v in result.items() if k.startswith("gemm_float32"))
    result["fp32_ceiling_256in_64out_tok_s"] = gemm / (5 * GFLOP_PER_TOKEN)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = ap.parse_args()
    result = measure()
    for key, value in result.items():
        print(f"{key:38s} {value:.1f}" if isinstance(value, float) else f"{key:38s} {value}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
