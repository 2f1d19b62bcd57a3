"""GFLOP/s of the int8-activation kernels (csrc/qdot.c: GGUF's formats and `--quantization int8`'s
I8) against oneDNN's float32 GEMM (torch) on the default model's layer shapes, at 1, 8, 32 and 256
activation rows; where the CPU has AMX, the kernels' vector path and tile path both (the default
takes the tiles from quant_linear.AMX_MIN_ROWS). Runs alternate (A B A B ...) and the best of each is reported, so a
busy machine skews all alike. `--baseline REV` adds a git revision's kernels, built for this CPU
and loaded beside this checkout's, on the same path (tiles where the CPU has AMX, else vectors),
in the same alternation, and the ratio of this checkout's rate to it.

    python benchmarks/quant_kernels.py [--formats Q4_1,Q8_0,Q4_0,I8] [--repeats 5] [--seconds 0.2] [--baseline REV]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernel_revision import revision_kernels  # noqa: E402

from pagoda.kernels import cpu  # noqa: E402
from pagoda.model_executor.quant_linear import pack_gguf, quant_matmul, quantize_int8  # noqa: E402
from tests.kernels.test_quant_kernels import gguf_rows  # noqa: E402

# (name, out, in) of SmolLM2-135M: q/o, k or v, gate or up, down, the tied LM head
SHAPES = [("576x576", 576, 576), ("576x192", 192, 576), ("576x1536", 1536, 576), ("1536x576", 576, 1536)]
HEAD = ("head 576x49152", 49152, 576)
ROWS = (1, 8, 16, 32, 256)


def rate(fn, flops: float, seconds: float) -> float:
    """GFLOP/s of fn over at least `seconds` of calls."""
    fn()
    calls, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        fn()
        calls += 1
    return flops * calls / elapsed / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", default="Q4_1,Q8_0,Q4_0,I8")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=0.2)
    parser.add_argument("--baseline", help="a git revision whose kernels run beside this checkout's")
    args = parser.parse_args()
    lib = cpu.load()
    print(f"kernels: {'+'.join(lib.isa)}, threads {torch.get_num_threads()}")
    # path name -> (kernels, tiles)
    paths = {"vectors": (lib, False), "AMX tiles": (lib, True)} if lib.amx else {"vectors": (lib, False)}
    with tempfile.TemporaryDirectory() as tmp:
        if args.baseline:
            path = "AMX tiles" if lib.amx else "vectors"
            paths[f"{args.baseline} {path}"] = (revision_kernels(args.baseline, Path(tmp)), lib.amx)
        measure(args, lib, paths)


def measure(args: argparse.Namespace, lib, paths: dict) -> None:
    """One row per format, shape and row count: each path's best rate, oneDNN's, and the ratios."""
    mine = "AMX tiles" if lib.amx else "vectors"
    baseline = next((p for p in paths if p not in ("vectors", "AMX tiles")), None)
    columns = " | ".join(f"int8 {path} GFLOP/s" for path in paths)
    ratio = f" | {mine} / {baseline}" if baseline else ""
    print(f"| format | shape | M | {columns} | oneDNN fp32 GFLOP/s | best / oneDNN{ratio} |")
    print("|---" * (len(paths) + 5 + bool(baseline)) + "|")
    for fmt in args.formats.split(","):
        for name, n, k in SHAPES + [HEAD]:
            weight = torch.randn(n, k)
            if fmt == "I8":
                packed = quantize_int8(weight)
            else:
                packed = pack_gguf(lib, fmt, torch.from_numpy(gguf_rows(fmt, weight)[0]), k)
            for m in ROWS if (name, n, k) != HEAD else (1, 8, 16, 32):
                x = torch.randn(m, k)
                flops = 2.0 * m * n * k
                ours, theirs = dict.fromkeys(paths, 0.0), 0.0
                for _ in range(args.repeats):
                    for path, (kernels, tiles) in paths.items():
                        run = partial(quant_matmul, kernels, x, packed, None, tiles=tiles)
                        ours[path] = max(ours[path], rate(run, flops, args.seconds))
                    theirs = max(theirs, rate(partial(torch.mm, x, weight.T), flops, args.seconds))
                cells = " | ".join(f"{ours[path]:.1f}" if ours[path] else "-" for path in paths)
                best = max(v for p, v in ours.items() if p != baseline) / theirs
                versus = f" | {ours[mine] / ours[baseline]:.2f}" if baseline else ""
                print(f"| {fmt} | {name} | {m} | {cells} | {theirs:.1f} | {best:.2f}{versus} |", flush=True)


if __name__ == "__main__":
    main()
