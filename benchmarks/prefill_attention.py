"""Prefill attention over a cached prefix (csrc/attention.c's `pagoda_prefill_attention`, the fp32
kernel of deterministic serving), A/B: a git revision's kernels (default main) against this
checkout's, each built for this CPU from its own csrc/ and both loaded in one process, timed in
alternating rounds (a shared machine slows both alike); every case first compares the outputs of
the two: the same bits, or (where the arithmetic changed) the largest absolute difference. Shapes
of the default model (SmolLM2-135M: 9 query heads, 3 kv heads of 64, blocks of 16, the blocks
shuffled as a pool leaves them):

- hit: one request's 46 new rows after 1,024 cached tokens (a shared-prefix hit);
- hit x8: eight such requests in one call;
- 4,000-token prompt: its chunked prefill, 512-token chunks over the growing cache (one call each);
- 256-token prompt: one prompt of the serving benchmark's shape, in one call.

`--decode` also times decode attention (`pagoda_paged_decode_attention`), 30 layers' caches (as many
as the model has, each its own, so that they do not fit the L3) per timed call, float32 and
bfloat16 caches: 32 requests of 300 tokens, 8 of 1,100 (their own, or sharing a 1,024-token
prefix's blocks), one of 4,000.

`--step` also times the whole hit step offline, each tree in its own process, alternated: an fp32
`LLM` (--model) caches a 1,024-token prefix, then `generate(prefix + 46 new tokens, max_tokens=1)`.

    PYTHONPATH=. python benchmarks/prefill_attention.py [--baseline main] [--rounds 7] [--threads N] [--decode] [--step]

Prints one line per case: the median over rounds of each side's median call time, its GFLOP/s
(4 flops per query head, head lane and key seen: scores and weighted values) and the ratio of
the times (this / baseline: below 1 is faster) and the outputs' largest difference (0: the same bits).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from kernel_revision import CSRC, ROOT, build, compare, extract

from pagoda.kernels import cpu

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
MODEL = "/root/.cache/pagoda-peers/models/smollm2-135m-instruct"


def calls(cached: int, rows: int, requests: int, chunk: int):
    """The kernel calls of `requests` prompts of cached + rows tokens whose first `cached` are in the
    cache, `chunk` rows a call (all requests in each call); their flops."""
    total = cached + rows
    blocks = -(-total // BLOCK)
    kv = torch.randn(2, requests * blocks, BLOCK, KV_HEADS, HEAD_DIM)
    tables = torch.randperm(requests * blocks, dtype=torch.int32).view(requests, blocks).contiguous()
    out, flops = [], 0.0
    for start in range(cached, total, chunk):
        size = min(chunk, total - start)
        query = torch.randn(requests * size, HEADS, HEAD_DIM)
        query_start = torch.arange(0, requests * size + 1, size, dtype=torch.int32)
        seq_lens = torch.full((requests,), start + size, dtype=torch.int32)
        out.append((query, kv, tables, query_start, seq_lens))
        flops += requests * 4 * HEADS * HEAD_DIM * sum(p + 1 for p in range(start, start + size))
    return out, flops


def run_calls(lib, batch) -> torch.Tensor:
    outs = []
    for query, kv, tables, query_start, seq_lens in batch:
        out = torch.empty_like(query)
        cpu.prefill_attention(lib, out, query, kv, tables, query_start, seq_lens, HEAD_DIM**-0.5)
        outs.append(out)
    return torch.cat(outs)


def kernel_cases(libs, rounds: int, seconds: float, tokens: int) -> list[dict]:
    torch.manual_seed(0)
    cases = {
        "hit: 46 rows after 1,024 cached": calls(1024, 46, 1, 46),
        "hit x8: 8 requests of 46 after 1,024": calls(1024, 46, 8, 46),
        f"{tokens:,}-token prompt in 512-token chunks": calls(0, tokens, 1, 512),
        "256-token prompt": calls(0, 256, 1, 256),
    }
    results = []
    for name, (batch, flops) in cases.items():
        timed = compare(libs, lambda lib, batch=batch: run_calls(lib, batch), rounds, seconds)
        results.append({"case": name, "gflops": flops / 1e9, **timed})
    return results


LAYERS = 30  # the default model's


def decode_case(batch: int, tokens: int, dtype: torch.dtype, shared: int = 0):
    """A decode step's attention over every layer: each layer's own cache (batch requests of
    `tokens` tokens, the last one new, their first `shared` tokens in the same blocks: a shared
    prefix, a whole number of blocks), the same queries."""
    blocks, shared_blocks = -(-tokens // BLOCK), shared // BLOCK
    own = batch * (blocks - shared_blocks)
    pool = torch.randperm(shared_blocks + own, dtype=torch.int32)
    tables = torch.cat(
        [pool[:shared_blocks].expand(batch, shared_blocks), pool[shared_blocks:].view(batch, -1)], dim=1
    ).contiguous()
    seq_lens = torch.full((batch,), tokens, dtype=torch.int32)
    slots = (tables[:, (tokens - 1) // BLOCK].long() * BLOCK + (tokens - 1) % BLOCK).contiguous()
    query = torch.randn(batch, HEADS, HEAD_DIM)
    key, value = torch.randn(batch, KV_HEADS, HEAD_DIM), torch.randn(batch, KV_HEADS, HEAD_DIM)
    caches = [torch.randn(2, shared_blocks + own, BLOCK, KV_HEADS, HEAD_DIM).to(dtype) for _ in range(LAYERS)]
    return query, key, value, caches, slots, tables, seq_lens


def run_decode(lib, case) -> torch.Tensor:
    query, key, value, caches, slots, tables, seq_lens = case
    outs = []
    for cache in caches:
        out = torch.empty_like(query)
        cpu.paged_decode_attention(lib, out, query, key, value, cache, slots, tables, seq_lens, HEAD_DIM**-0.5)
        outs.append(out)
    return torch.cat(outs)


def decode_cases(libs, rounds: int, seconds: float) -> list[dict]:
    torch.manual_seed(0)
    results = []
    for batch, tokens, shared in ((32, 300, 0), (8, 1100, 0), (8, 1100, 1024), (1, 4000, 0)):
        for dtype in (torch.float32, torch.bfloat16):
            case = decode_case(batch, tokens, dtype, shared)
            timed = compare(libs, lambda lib, case=case: run_decode(lib, case), rounds, seconds)
            sharing = f" sharing {shared:,}" if shared else ""
            name = f"decode {batch} x {tokens:,}{sharing}, {LAYERS} layers, {str(dtype)[6:]} cache"
            results.append({"case": name, **timed})
    return results


STEP_CHILD = """
import json, os, random, statistics, sys, time
os.environ.setdefault("HF_HUB_OFFLINE", "1")
from pagoda import LLM, SamplingParams
model, repeats, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
llm = LLM(model, dtype="float32", max_model_len=2048, kv_cache_memory=1.0, threads=threads)
rng = random.Random(0)
vocab = llm.engine.config.model.vocab_size
prefix = [rng.randrange(100, vocab) for _ in range(1024)]
params = SamplingParams(temperature=0.0, max_tokens=1)
def hit():
    start = time.perf_counter()
    llm.generate(prefix + [rng.randrange(100, vocab) for _ in range(46)], params, use_tqdm=False)
    return time.perf_counter() - start
hit(); hit()  # the prefix cached, the kernels built and warm
print(json.dumps(statistics.median(hit() for _ in range(repeats))))
"""


def step_case(trees: list[Path], model: str, rounds: int, repeats: int, threads: int) -> dict:
    """The whole hit step offline, each tree in a fresh process, alternated; medians in ms."""
    times: list[list[float]] = [[] for _ in trees]
    for _ in range(rounds):
        for i, tree in enumerate(trees):
            env = {**os.environ, "PYTHONPATH": str(tree), "PAGODA_CONFIGURE_LOGGING": "0"}
            command = [sys.executable, "-c", STEP_CHILD, model, str(repeats), str(threads)]
            child = subprocess.run(command, env=env, capture_output=True, text=True)
            if child.returncode != 0:
                raise RuntimeError(f"hit step in {tree} failed:\n{child.stderr[-3000:]}")
            times[i].append(json.loads(child.stdout.strip().splitlines()[-1]))
    base, this = (statistics.median(t) * 1e3 for t in times)
    return {"case": "whole hit step offline (generate, max_tokens=1)", "base_ms": base, "this_ms": this}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline", default="main", help="git revision whose kernels are the baseline")
    ap.add_argument("--rounds", type=int, default=7, help="alternating A/B rounds per case")
    ap.add_argument("--seconds", type=float, default=0.5, help="timing per build per round")
    ap.add_argument("--tokens", type=int, default=4000, help="the long prompt's length")
    ap.add_argument("--decode", action="store_true", help="also time decode attention")
    ap.add_argument("--step", action="store_true", help="also time the whole hit step offline")
    ap.add_argument("--step-repeats", type=int, default=10, help="hit steps timed per process")
    ap.add_argument("--model", default=MODEL, help="an fp32 HF directory of the default model, for --step")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(), help="threads of the kernel and model")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    threads = args.threads
    print(f"ISA {'+'.join(cpu.cpu_isa())}, {threads} threads; {args.baseline} against this checkout, medians")
    with tempfile.TemporaryDirectory() as tmp:
        base = extract(args.baseline, Path(tmp) / "base")
        libs = [build(base / CSRC, Path(tmp) / "base.so"), build(ROOT / CSRC, Path(tmp) / "this.so")]
        rows = kernel_cases(libs, args.rounds, args.seconds, args.tokens)
        if args.decode:
            rows += decode_cases(libs, args.rounds, args.seconds)
        if args.step:
            rows.append(step_case([base, ROOT], args.model, args.rounds, args.step_repeats, threads))
    print(f"{'case':<62}{args.baseline + ' ms':>10}{'this ms':>10}{'ratio':>7}{'GFLOP/s':>17}{'max diff':>10}")
    for r in rows:
        rates = " " * 17
        if "gflops" in r:
            rates = f"{r['gflops'] / r['base_ms'] * 1e3:>8.1f}{r['gflops'] / r['this_ms'] * 1e3:>9.1f}"
        differ = f"{r['differ']:>10.1e}" if "differ" in r else ""
        times = f"{r['base_ms']:>10.2f}{r['this_ms']:>10.2f}{r['this_ms'] / r['base_ms']:>7.2f}"
        print(f"{r['case']:<62}{times}{rates}{differ}")


if __name__ == "__main__":
    main()
