"""Compile the attention kernels for Hopper (sm_90) without a GPU, as the launchers configure them.

The interpreter never compiles, so this is the CPU check that the kernels still lower to PTX and
a cubin, and that every configuration's shared memory fits the chip. Run it in a process without
TRITON_INTERPRET (test_hopper_compile.py does); prints one line per kernel; exits non-zero on failure.
`--all` compiles every dtype and model shape (minutes), instead of the few the test needs.
"""

from __future__ import annotations

import os
import sys

import torch

assert not os.environ.get("TRITON_INTERPRET"), "the interpreter does not compile"

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from pagoda.attention import triton_kernels as k  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)
SHARED_LIMIT = 227 * 1024  # bytes per block on sm_90
TRITON_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
INDEX_POINTERS = {"slot_ptr": "*i64", "qsl_ptr": "*i32", "seq_lens_ptr": "*i32", "block_tables_ptr": "*i32"}
FLOAT_SCALARS = {"scale_log2"}


def compile_kernel(kernel, dtype: torch.dtype, head_dim: int, constexprs: dict, num_warps: int, num_stages: int):
    """As a launch would: pointers, strides and a head_dim divisible by 16 are marked so (Triton
    specializes on it), which is what lets the compiler vectorize and pipeline the loads; not the
    arguments the kernel leaves unspecialized (they vary from step to step)."""
    signature, attrs = {}, {}
    unspecialized = {p.name for p in kernel.params if p.do_not_specialize or p.do_not_specialize_on_alignment}
    for i, name in enumerate(kernel.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            fp32 = name.startswith("tmp_")
            signature[name] = INDEX_POINTERS.get(name, "*fp32" if fp32 else "*" + TRITON_DTYPES[dtype])
            if name not in unspecialized:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "fp32" if name in FLOAT_SCALARS else "i32"
            if name in unspecialized:
                continue
            if name.startswith("stride_") or (name == "head_dim" and head_dim % 16 == 0):
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(kernel, signature, constexprs, attrs)
    return triton.compile(src, target=HOPPER, options={"num_warps": num_warps, "num_stages": num_stages})


def cases(full: bool):
    """Every dtype and model shape with full; else Llama-3-8B's in bf16 and an odd shape in fp32."""
    if full:
        for dtype in TRITON_DTYPES:
            for group, head_dim in ((4, 128), (1, 64), (8, 256), (3, 96)):
                yield from kernel_cases(dtype, group, head_dim, max_query_lens=(1, 4, 512))
    else:
        yield from kernel_cases(torch.bfloat16, 4, 128, max_query_lens=(1, 512))
        yield from attention_cases(torch.float32, 3, 96, max_query_lens=(512,))


def kernel_cases(dtype: torch.dtype, group: int, head_dim: int, max_query_lens: tuple[int, ...]):
    """(label, kernel, dtype, head_dim, constexprs, num_warps, num_stages) for each kernel at one shape."""
    shape = f"{TRITON_DTYPES[dtype]} group={group} d={head_dim}"
    pad = k._pow2(head_dim)
    store = {"BLOCK_SIZE": 16, "HEADS_PAD": 8, "HEAD_PAD": pad}
    yield f"store_kv {shape}", k._store_kv_kernel, dtype, head_dim, store, 4, 1
    yield from attention_cases(dtype, group, head_dim, max_query_lens)
    cfg = k.choose_split_config(group, dtype)
    constexprs = attention_constexprs(group, head_dim, cfg, dtype)
    yield f"split {shape}", k._paged_attention_split_kernel, dtype, head_dim, constexprs, cfg.num_warps, cfg.num_stages
    merge = {"SPLITS_PAD": 32, "HEAD_PAD": pad}
    yield f"merge {shape}", k._merge_splits_kernel, dtype, head_dim, merge, 4, 1


def attention_cases(dtype: torch.dtype, group: int, head_dim: int, max_query_lens: tuple[int, ...]):
    shape = f"{TRITON_DTYPES[dtype]} group={group} d={head_dim}"
    for max_q in max_query_lens:
        cfg = k.choose_config(group, head_dim, dtype, max_q)
        constexprs = attention_constexprs(group, head_dim, cfg, dtype) | {"ONE_TILE_PER_SEQ": cfg.one_tile_per_seq}
        label = f"attention max_q={max_q} {shape}"
        yield label, k._paged_attention_kernel, dtype, head_dim, constexprs, cfg.num_warps, cfg.num_stages


def attention_constexprs(group: int, head_dim: int, config: k.TileConfig, dtype: torch.dtype) -> dict:
    return {
        "GROUP": group,
        "BLOCK_SIZE": 16,
        "BLOCK_M": config.block_m,
        "BLOCK_Q": config.block_q(group),
        "TILE_N": config.tile_n,
        "HEAD_PAD": k._pow2(head_dim),
        "DOT_PRECISION": k._dot_precision(dtype),
    }


def main() -> int:
    failures = 0
    for label, *spec in cases(full="--all" in sys.argv):
        try:
            shared = compile_kernel(*spec).metadata.shared
        except Exception as e:  # report every configuration, then fail
            print(f"FAIL {label}: {type(e).__name__}: {e}")
            failures += 1
            continue
        ok = shared <= SHARED_LIMIT
        failures += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {label}: shared memory {shared} bytes")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
