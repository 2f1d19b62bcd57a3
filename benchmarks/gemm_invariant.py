"""The batch-invariant float32 GEMM (csrc/gemm.c's `pagoda_gemm_invariant`, deterministic serving's
linears), A/B: a git revision's kernels (default main) against this checkout's, each built for this
CPU from its own csrc/ and both loaded in one process, timed in alternating rounds (a shared
machine slows both alike; kernel_revision.compare, as prefill_attention.py). A call is every
linear of the default model's 30 layers (qkv 960 x 576, o 576 x 576, gate/up 3,072 x 576, down
576 x 1,536), each layer its own weights, so that they stream from memory as in a step; every row
count first checks that both give the same bits.

    PYTHONPATH=. python benchmarks/gemm_invariant.py [--baseline main] [--rows 8,53,100,288] [--rounds 7]
        [--seconds 0]

Prints per row count: the median over rounds of each side's median call time (a round: one warm
call, then calls for --seconds, at least one), its GFLOP/s, the ratio (this / baseline: below 1 is
faster) and whether the two give the same bits.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from kernel_revision import CSRC, ROOT, build, compare, revision_kernels

from pagoda.kernels import cpu

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (n, k) of the default model's linears
LAYERS = 30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default="main")
    parser.add_argument("--rows", default="8,16,53,100,150,288,400")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--seconds", type=float, default=0.0, help="timed calls per side and round (at least one)")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp())
    libs = (revision_kernels(args.baseline, tmp / "base"), build(ROOT / CSRC, tmp / "this.so"))
    torch.manual_seed(0)
    layers = [[(cpu.pack_panels(libs[1], torch.randn(n, k)), n) for n, k in SHAPES] for _ in range(LAYERS)]

    def call(lib, inputs, every: bool) -> torch.Tensor:
        """Every output of the call, or (timed: gathering them all would cost a copy as large as the
        outputs, on top of the linears) only the last one's."""
        outs = [cpu.gemm_invariant(lib, inputs[p.shape[1]], p, None, n) for layer in layers for p, n in layer]
        return torch.cat([o.flatten() for o in outs]) if every else outs[-1]

    isa = "+".join(libs[1].isa)
    print(f"ISA {isa}, {torch.get_num_threads()} threads; {args.baseline} against this checkout, medians")
    for m in (int(r) for r in args.rows.split(",")):
        inputs = {k: torch.randn(m, k) for k in {k for _, k in SHAPES}}
        same = torch.equal(*(call(lib, inputs, every=True) for lib in libs))
        timed = compare(libs, lambda lib, inputs=inputs: call(lib, inputs, every=False), args.rounds, args.seconds)
        b, t = timed["base_ms"] / 1e3, timed["this_ms"] / 1e3
        flops = 2 * m * sum(n * k for n, k in SHAPES) * LAYERS
        print(
            f"{m:5d} rows: {b * 1e3:7.1f} ms ({flops / b / 1e9:4.0f} GFLOP/s) -> {t * 1e3:7.1f} ms "
            f"({flops / t / 1e9:4.0f} GFLOP/s), ratio {t / b:.3f}, same bits {same}"
        )


if __name__ == "__main__":
    main()
