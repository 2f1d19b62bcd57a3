"""Device check for the Triton attention kernels: correctness against the torch reference at model
shapes, then decode and prefill timings with achieved bandwidth and throughput.

    python benchmarks/gpu_kernels.py              # on a CUDA GPU (1 to 2.5 minutes on an H200, estimated)
    python benchmarks/gpu_kernels.py --dry-run    # tiny shapes on CPU under TRITON_INTERPRET=1

Writes $OUT/gpu_kernels.json when OUT is set (or --out). Exits 1 when a correctness case fails.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Launch configurations timed against the defaults, to tune them: (tile_n, num_warps, num_stages)
# for decodes, (block_m, tile_n, num_warps, num_stages) for prefills.
DECODE_TILES = ((64, 4, 2), (64, 4, 3), (128, 4, 2), (128, 4, 3), (32, 4, 4), (128, 8, 3))
PREFILL_TILES = ((128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 4, 3), (64, 64, 4, 3), (128, 128, 8, 2))

# bf16 is not checked in the dry run: Triton's interpreter computes bf16 dot products wrongly.
TOLERANCE = {"float32": 1e-3, "bfloat16": 2e-2, "float16": 5e-3}


@dataclass(frozen=True)
class Model:
    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class Plan:
    """Shapes and sizes of one run: the device's, or the dry run's tiny ones."""

    device: str
    models: tuple[Model, ...]
    dtypes: tuple[str, ...]
    block_size: int
    mixed: tuple[tuple[int, int], ...]  # (query_len, seq_len), decodes first
    speculative: tuple[tuple[int, int], ...]  # a few query tokens per request: one program each
    long_decodes: tuple[int, ...]
    decode_batches: tuple[int, ...]
    decode_contexts: tuple[int, ...]
    sweep_batches: tuple[int, ...]
    sweep_context: int
    tile_decode: tuple[int, int]  # (batch, context) for the decode tile sweep
    tile_prefill: int  # query length of the one prefill in the prefill tile sweep
    prefills: tuple[tuple[int, int, int], ...]  # (requests, query_len, cached context)


DEVICE_PLAN = Plan(
    device="cuda",
    models=(
        Model("llama3-8b", 32, 8, 128),
        Model("qwen2.5-7b", 28, 4, 128),  # a group of 7 query heads per KV head
        Model("llama3.2-1b", 32, 8, 64),
    ),
    dtypes=("bfloat16", "float32"),
    block_size=16,
    mixed=((1, 1), (1, 16), (1, 17), (1, 500), (1, 2049), (1, 4000), (4, 300), (512, 1500), (1000, 1000), (77, 77)),
    speculative=((1, 900), (4, 300), (4, 4097), (3, 16)),
    long_decodes=(8192, 3000),
    decode_batches=(1, 4, 16, 64, 256),
    decode_contexts=(512, 2048, 8192),
    sweep_batches=(1, 8),
    sweep_context=8192,
    tile_decode=(64, 4096),
    tile_prefill=4096,
    prefills=((1, 512, 0), (1, 2048, 0), (1, 8192, 0), (4, 2048, 0), (1, 2048, 6144)),
)

DRY_PLAN = Plan(
    device="cpu",
    models=(Model("tiny", 4, 2, 32), Model("tiny-group3", 3, 1, 48)),
    dtypes=("float32",),
    block_size=8,
    mixed=((1, 1), (1, 8), (1, 9), (4, 20), (8, 30), (40, 40)),
    speculative=((1, 30), (4, 20), (3, 9)),
    long_decodes=(70, 33),
    decode_batches=(1, 2),
    decode_contexts=(16, 520),  # 520: the automatic choice splits
    sweep_batches=(1,),
    sweep_context=64,
    tile_decode=(2, 40),
    tile_prefill=48,
    prefills=((1, 48, 0), (1, 16, 32)),
)


def main() -> int:
    args = parse_args()
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    sys.path.insert(0, str(REPO))
    plan = DRY_PLAN if args.dry_run else DEVICE_PLAN
    out_path = args.out or (Path(os.environ["OUT"]) / "gpu_kernels.json" if os.environ.get("OUT") else None)
    return Check(plan, out_path, args.budget).run()


def parse_args() -> argparse.Namespace:
    description = __doc__.split("\n\n")[0]
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU under Triton's interpreter")
    parser.add_argument("--out", type=Path, help="JSON results path (default: $OUT/gpu_kernels.json if OUT is set)")
    parser.add_argument(
        "--budget", type=float, default=150, help="seconds after which timing cases are skipped (default 150)"
    )
    return parser.parse_args()


class Check:
    def __init__(self, plan: Plan, out_path: Path | None, budget_s: float):
        import torch

        from pagoda.attention.torch_backend import TorchAttentionBackend
        from pagoda.attention.triton_backend import TritonAttentionBackend

        if plan.device == "cuda" and not torch.cuda.is_available():
            raise SystemExit("no CUDA device; use --dry-run for the CPU path")
        self.torch = torch
        self.plan = plan
        self.out_path = out_path
        self.device = torch.device(plan.device)
        self.reference = TorchAttentionBackend()
        self.triton_backend = TritonAttentionBackend
        self.results: dict = {"plan": plan.device, "environment": environment(torch), "correctness": []}
        self.started = time.perf_counter()
        self.budget_s = budget_s

    def in_time(self, case: str) -> bool:
        """Timings stop once the budget is spent (fresh machines compile every kernel variant first)."""
        if time.perf_counter() - self.started < self.budget_s:
            return True
        self.results["skipped_for_time"].append(case)
        print(f"skipped for time: {case}")
        return False

    def run(self) -> int:
        self.correctness()
        self.save()
        failed = [c["case"] for c in self.results["correctness"] if not c["ok"]]
        if failed:  # timings of wrong kernels mean nothing
            print(f"FAILED correctness: {failed}")
            return 1
        self.results["copy_bandwidth_gbps"] = self.copy_bandwidth()
        self.results["skipped_for_time"] = []
        self.decode_timings()
        self.prefill_timings()
        self.split_sweep()
        self.tile_sweep()
        self.save()
        print(f"all correctness cases passed; {time.perf_counter() - self.started:.0f}s")
        return 0

    # ------------------------------------------------------------------------------------------
    # correctness

    def correctness(self) -> None:
        p = self.plan
        for dtype in p.dtypes:
            for model in p.models if dtype == p.dtypes[0] else p.models[:1]:  # all in the serving dtype
                self.compare(f"{model.name} {dtype} mixed", model, dtype, p.mixed)
            model = p.models[0]
            self.compare(f"{model.name} {dtype} speculative", model, dtype, p.speculative)
            decodes = tuple((1, s) for s in p.long_decodes)
            self.compare(f"{model.name} {dtype} long decodes, auto split", model, dtype, decodes)
            self.compare(f"{model.name} {dtype} long decodes, no split", model, dtype, decodes, splits=1)
            self.compare(f"{model.name} {dtype} padded lanes", model, dtype, decodes, padded=6)
            self.compare(f"{model.name} {dtype} padded lanes, split 4", model, dtype, decodes, padded=6, splits=4)
            self.compare(f"{model.name} {dtype} block size 1", model, dtype, p.mixed, block_size=1)

    def compare(self, case: str, *args, **kwargs) -> None:
        """One correctness case; a crash is recorded as a failure and the next case still runs."""
        try:
            result = self.compare_once(*args, **kwargs)
        except Exception as e:  # a device run is scarce: report every case
            result = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        self.results["correctness"].append({"case": case, **result})
        detail = result.get("error") or f"max |err| {result['max_abs_err']:.2e}, cache ok: {result['cache_matches']}"
        print(f"{'ok  ' if result['ok'] else 'FAIL'} {case}: {detail}")

    def compare_once(self, model, dtype, requests, splits=None, padded=0, block_size=None) -> dict:
        """Triton in `dtype` against the torch reference in fp32 on the same (rounded) inputs."""
        torch = self.torch
        block_size = block_size or self.plan.block_size
        step = make_step(torch, self.device, model, getattr(torch, dtype), requests, block_size, padded)
        backend = self.triton_backend(decode_splits=splits)
        cache = step["kv_cache"].clone()
        out = backend.forward(
            step["query"], step["key"], step["value"], cache, backend.build_metadata(step["inputs"]), step["scale"]
        )
        real = unpadded(torch, step, padded)
        ref_cache = real["kv_cache"].to(torch.float32, copy=True)
        ref_out = self.reference.forward(
            real["query"].float(),
            real["key"].float(),
            real["value"].float(),
            ref_cache,
            self.reference.build_metadata(real["inputs"]),
            real["scale"],
        )
        num_real = ref_out.shape[0]
        err = (out[:num_real].float() - ref_out).abs()
        cache_ok = bool(torch.equal(cache.float(), ref_cache))
        finite = bool(torch.isfinite(out).all())
        max_err = float(err.max())
        ok = max_err <= TOLERANCE[dtype] and cache_ok and finite
        return {
            "ok": ok,
            "max_abs_err": max_err,
            "mean_abs_err": float(err.mean()),
            "cache_matches": cache_ok,
            "finite": finite,
            "tolerance": TOLERANCE[dtype],
        }

    # ------------------------------------------------------------------------------------------
    # timings (bf16 on the device; the dry run times fp32 once, only to exercise the code)

    def timing_dtype(self):
        return self.torch.bfloat16 if self.plan.device == "cuda" else self.torch.float32

    def decode_timings(self) -> None:
        rows = self.results["decode"] = []
        model = self.plan.models[0]
        for batch in self.plan.decode_batches:
            for context in self.plan.decode_contexts:
                if not self.in_time(f"decode B={batch} ctx={context}"):
                    continue
                auto = self.time_decode(model, batch, context, splits=None)
                single = self.time_decode(model, batch, context, splits=1) if auto["splits"] > 1 else auto
                rows.append({"batch": batch, "context": context, "auto": auto, "no_split": single})
                share = auto["gbps"] / self.results["copy_bandwidth_gbps"]
                print(
                    f"decode B={batch:4d} ctx={context:5d}: {auto['us']:8.1f} us {auto['gbps']:7.0f} GB/s "
                    f"({share:.0%} of copy; splits {auto['splits']}; unsplit {single['us']:.1f} us)"
                )
        self.save()

    def split_sweep(self) -> None:
        rows = self.results["split_sweep"] = []
        model = self.plan.models[0]
        for batch in self.plan.sweep_batches:
            for splits in (1, 2, 4, 8, 16, 32):
                if not self.in_time(f"split sweep B={batch} splits={splits}"):
                    continue
                r = self.time_decode(model, batch, self.plan.sweep_context, splits=splits)
                rows.append({"batch": batch, "context": self.plan.sweep_context, **r})
                print(f"split sweep B={batch} ctx={self.plan.sweep_context} splits={splits:2d}: {r['us']:8.1f} us")
        self.save()

    def tile_sweep(self) -> None:
        """Attention launches alone (no KV store) under other tile configurations."""
        from pagoda.attention.triton_kernels import TileConfig

        rows = self.results["tile_sweep"] = []
        model = self.plan.models[0]
        batch, context = self.plan.tile_decode
        q_len = self.plan.tile_prefill
        decode = [TileConfig(16, n, True, w, s) for n, w, s in DECODE_TILES]  # 16 rows: a group of 4 heads
        prefill = [TileConfig(m, n, False, w, s) for m, n, w, s in PREFILL_TILES]
        sweeps = (("decode", ((1, context),) * batch, decode), ("prefill", ((q_len, q_len),), prefill))
        for kind, requests, configs in sweeps:
            step = make_step(self.torch, self.device, model, self.timing_dtype(), requests, 16, 0)
            for config in configs:
                if not self.in_time(f"tile sweep {kind} {config}"):
                    continue
                row = {"kind": kind, "requests": len(requests), "config": config.__dict__}
                try:
                    row["us"] = self.time_attention(step, config) * 1e6
                except Exception as e:  # e.g. out of shared memory: a result too
                    row["error"] = f"{type(e).__name__}: {e}"
                rows.append(row)
                print(f"tile sweep {kind} {config}: {row.get('us', row.get('error'))}")
        self.save()

    def time_attention(self, step: dict, config) -> float:
        from pagoda.attention import triton_kernels as kernels

        i = step["inputs"]
        q, cache, scale = step["query"], step["kv_cache"], step["scale"]
        out = self.torch.empty_like(q)
        tables = (i.query_start_loc, i.seq_lens, i.block_tables)
        max_q = max(i.query_lens_cpu)
        return self.bench(
            lambda: kernels.paged_attention(
                out, q, cache, *tables, scale, num_tokens=q.shape[0], max_query_len=max_q, config=config
            )
        )

    def time_decode(self, model: Model, batch: int, context: int, splits: int | None) -> dict:
        torch = self.torch
        dtype = self.timing_dtype()
        step = make_step(torch, self.device, model, dtype, tuple((1, context) for _ in range(batch)), 16, 0)
        backend = self.triton_backend(decode_splits=splits)
        chosen = backend.decode_splits(backend.build_metadata(step["inputs"]), step["kv_cache"])
        seconds = self.time_forward(backend, step)
        elt = dtype.itemsize
        kv_bytes = 2 * batch * context * model.num_kv_heads * model.head_dim * elt
        io_bytes = 2 * batch * model.num_heads * model.head_dim * elt
        return {"splits": chosen, "us": seconds * 1e6, "gbps": (kv_bytes + io_bytes) / seconds / 1e9}

    def prefill_timings(self) -> None:
        rows = self.results["prefill"] = []
        model = self.plan.models[0]
        for num_reqs, q_len, context in self.plan.prefills:
            if not self.in_time(f"prefill {num_reqs}x{q_len} after {context}"):
                continue
            requests = tuple((q_len, context + q_len) for _ in range(num_reqs))
            step = make_step(self.torch, self.device, model, self.timing_dtype(), requests, 16, 0)
            seconds = self.time_forward(self.triton_backend(), step)
            pairs = num_reqs * sum(context + j + 1 for j in range(q_len))  # causal (query, key) pairs
            tflops = 4 * pairs * model.num_heads * model.head_dim / seconds / 1e12
            row = {"requests": num_reqs, "query_len": q_len, "context": context, "us": seconds * 1e6, "tflops": tflops}
            line = f"prefill {num_reqs}x{q_len} after {context}: {row['us']:9.1f} us {tflops:6.1f} TFLOP/s"
            if context == 0:
                row["torch_sdpa_us"] = self.time_torch_sdpa(model, step, num_reqs, q_len) * 1e6
                line += f", torch sdpa {row['torch_sdpa_us']:.1f} us"
            rows.append(row)
            print(line)
        self.save()

    def time_forward(self, backend, step: dict) -> float:
        """One layer's forward: store this step's keys and values, then attend."""
        metadata = backend.build_metadata(step["inputs"])
        q, k, v, cache, scale = (step[name] for name in ("query", "key", "value", "kv_cache", "scale"))
        return self.bench(lambda: backend.forward(q, k, v, cache, metadata, scale))

    def time_torch_sdpa(self, model: Model, step: dict, num_reqs: int, q_len: int) -> float:
        """The same fresh prefills, contiguous and with K/V heads expanded, through torch's fused kernel."""
        import torch.nn.functional as F

        group = model.num_heads // model.num_kv_heads
        shape = (num_reqs, q_len, -1, model.head_dim)
        q = step["query"].view(shape).transpose(1, 2)
        k = step["key"].view(shape).repeat_interleave(group, dim=2).transpose(1, 2)
        v = step["value"].view(shape).repeat_interleave(group, dim=2).transpose(1, 2)
        return self.bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))

    def copy_bandwidth(self) -> float:
        """Device-to-device copy, bytes read plus written: the ceiling decode bandwidth is judged by."""
        n = (1 << 30) if self.plan.device == "cuda" else (1 << 16)
        src = self.torch.empty(n, dtype=self.torch.uint8, device=self.device)
        dst = self.torch.empty_like(src)
        seconds = self.bench(lambda: dst.copy_(src))
        return 2 * n / seconds / 1e9

    def bench(self, fn) -> float:
        """Seconds per call: median of CUDA-event timings, or one call's wall time in the dry run."""
        if self.plan.device == "cuda":
            import triton.testing

            return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e3
        fn()
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    def save(self) -> None:
        self.results["elapsed_s"] = time.perf_counter() - self.started
        if self.out_path:
            self.out_path.parent.mkdir(parents=True, exist_ok=True)
            self.out_path.write_text(json.dumps(self.results, indent=1))


# ----------------------------------------------------------------------------------------------
# inputs


def make_step(torch, device, model: Model, dtype, requests, block_size: int, padded: int) -> dict:
    """A step of (query_len, seq_len) requests over a random paged cache holding their earlier context;
    `padded` trailing CUDA-graph lanes (slot -1, seq_len 0 or 1 on block 0)."""
    from pagoda.attention.backend import AttentionInputs, kv_cache_shape

    gen = torch.Generator(device="cpu").manual_seed(len(requests) * 1000 + sum(s for _, s in requests))
    query_lens = [q for q, _ in requests] + [1] * padded
    seq_lens = [s for _, s in requests] + [lane % 2 for lane in range(padded)]
    blocks = [math.ceil(s / block_size) for _, s in requests]
    num_blocks = sum(blocks) + 1
    pool = torch.randperm(num_blocks - 1, generator=gen) + 1
    tables = torch.zeros(len(query_lens), max(blocks) + 1, dtype=torch.int32)
    slots, used = [], 0
    for i, (q_len, seq_len) in enumerate(requests):
        tables[i, : blocks[i]] = pool[used : used + blocks[i]].int()
        used += blocks[i]
        pos = torch.arange(seq_len - q_len, seq_len)
        slots.append(tables[i, pos // block_size].long() * block_size + pos % block_size)
    slots.append(torch.full((padded,), -1, dtype=torch.long))
    num_decodes = next((i for i, q in enumerate(query_lens) if q != 1), len(query_lens))
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    inputs = AttentionInputs(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=tables.to(device),
        slot_mapping=torch.cat(slots).to(device),
        num_decodes=num_decodes,
        query_lens_cpu=tuple(query_lens),
        seq_lens_cpu=tuple(seq_lens),
        block_size=block_size,
        dtype=torch.float32,  # the torch reference runs on fp32 copies; the Triton backend ignores it
    )
    tokens = starts[-1]
    shape = kv_cache_shape(num_blocks, block_size, model.num_kv_heads, model.head_dim)

    def randn(*size):
        return torch.randn(*size, device=device, dtype=dtype)

    torch.manual_seed(tokens)
    return {
        "inputs": inputs,
        "query": randn(tokens, model.num_heads, model.head_dim),
        "key": randn(tokens, model.num_kv_heads, model.head_dim),
        "value": randn(tokens, model.num_kv_heads, model.head_dim),
        "kv_cache": randn(*shape),
        "scale": model.head_dim**-0.5,
    }


def unpadded(torch, step: dict, padded: int) -> dict:
    """The step without its padded lanes, which the torch reference cannot take (slot -1)."""
    if not padded:
        return step
    from pagoda.attention.backend import AttentionInputs

    i = step["inputs"]
    reqs = i.num_reqs - padded
    tokens = sum(i.query_lens_cpu[:reqs])
    inputs = AttentionInputs(
        query_start_loc=i.query_start_loc[: reqs + 1],
        seq_lens=i.seq_lens[:reqs],
        block_tables=i.block_tables[:reqs],
        slot_mapping=i.slot_mapping[:tokens],
        num_decodes=min(i.num_decodes, reqs),
        query_lens_cpu=i.query_lens_cpu[:reqs],
        seq_lens_cpu=i.seq_lens_cpu[:reqs],
        block_size=i.block_size,
        dtype=i.dtype,
    )
    sliced = {name: step[name][:tokens] for name in ("query", "key", "value")}
    return {**step, **sliced, "inputs": inputs}


def environment(torch) -> dict:
    import triton

    env = {"torch": torch.__version__, "triton": triton.__version__, "python": sys.version.split()[0]}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, sms=props.multi_processor_count, memory_gib=props.total_memory / 2**30)
    return env


if __name__ == "__main__":
    sys.exit(main())
