"""Builds and binds Pagoda's C kernels (csrc/*.c): compiled once per source version and CPU kind with
the system C compiler into Pagoda's cache, loaded with ctypes.

The kernels are built for the instruction sets this CPU has (`cpu_isa()`): AVX2 + FMA is the floor;
AVX-512, AVX512-BF16, VNNI and AMX are enabled where /proc/cpuinfo lists them, and the sources pick
their code paths from the compiler's feature macros. `PAGODA_CPU_ISA=avx2` caps the build at the
floor (to compare or test the AVX2 path on a wider CPU). Where they cannot be built (no compiler,
not x86-64 with AVX2 and FMA), `load()` returns None and callers keep to plain torch.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from pagoda.model_files import cache_root

logger = logging.getLogger(__name__)

SOURCES = sorted(Path(__file__).with_name("csrc").glob("*.[ch]"))
BASE_FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC"]
# each ISA level: the /proc/cpuinfo flags it needs and the compiler flags it enables, in order
ISA_LEVELS = (
    ("avx2", ("avx2", "fma", "f16c"), ("-mavx2", "-mfma", "-mf16c")),
    (
        "avx512",
        ("avx512f", "avx512bw", "avx512vl", "avx512dq"),
        ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"),
    ),
    ("avx512_bf16", ("avx512_bf16",), ("-mavx512bf16",)),
    ("avx512_vnni", ("avx512_vnni",), ("-mavx512vnni",)),
    ("amx", ("amx_tile", "amx_bf16", "amx_int8"), ("-mamx-tile", "-mamx-bf16", "-mamx-int8")),
)
_P, _I64 = ctypes.c_void_p, ctypes.c_long
_F, _INT = ctypes.c_float, ctypes.c_int
# The kernels that return nothing, by their argument types (csrc/*.c); each ends with the thread count.
_VOID_SIGNATURES = {
    "pagoda_paged_decode_attention": [_P, _P, _I64, _P, _I64, _P, _I64] + [_P] * 5 + [_I64] * 6 + [_F, _INT, _INT],
    "pagoda_store_kv": [_P, _P, _P, _I64, _P, _I64, _P, _I64, _I64, _INT, _INT],
    "pagoda_gemv": [_P] * 4 + [_I64] * 2 + [_INT],
    "pagoda_gemv_bf16": [_P, _P, _INT, _P, _INT, _P, _I64, _I64, _INT],
    "pagoda_rms_norm": [_P] * 3 + [_I64] * 2 + [_F, _INT, _INT],
    "pagoda_add_rms_norm": [_P] * 3 + [_I64] * 2 + [_F, _INT, _INT],
    "pagoda_rotary": [_P] * 4 + [_I64] * 4 + [_INT, _INT],
    "pagoda_silu_mul": [_P] * 2 + [_I64] * 2 + [_INT, _INT],
    "pagoda_pack_panels": [_P, _P, _I64, _I64, _INT],
    "pagoda_gemm_invariant": [_P, _I64, _P, _I64, _P, _P] + [_I64] * 3 + [_INT],
    "pagoda_gemm_invariant_groups": [_P, _I64, _P, _I64, _P, _P, _P] + [_I64] * 3 + [_INT],
    "pagoda_prefill_attention": [_P, _P, _I64] + [_P] * 5 + [_I64] * 6 + [_F, _INT, _INT],
    # qdot.c (GGUF blocks and I8, the format first), wrapped by model_executor/quant_linear.py
    "pagoda_qd_pack": [_INT, _P, _P, _I64, _I64, _INT],
    "pagoda_qd_dequant_rows": [_INT, _P, _P, _I64, _I64, _P, _INT],
    "pagoda_qd_matmul": [_INT] + [_P] * 4 + [_I64] * 4 + [_INT],
    # decoder.c, wrapped by model_executor/cpu_stack.py
    "pagoda_decoder_layers": [_P, _I64] + [_P] * 7 + [_F, _F, _F, _INT],
    # sample.c, wrapped by sample_rows below
    "pagoda_sample_rows": [_P, _I64, _I64, _INT, _P, _P, _P, _INT],
}
# bf16.c's GEMM on AMX tiles: built only with the amx level
_AMX_SIGNATURES = {
    "pagoda_bf16_pack_tiles": [_P, _P, _I64, _I64, _INT],
    "pagoda_gemm_bf16": [_P] * 4 + [_I64] * 3 + [_INT],
}


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        line = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return frozenset()
    return frozenset(line.split(":", 1)[1].split())


def cpu_isa(flags: frozenset[str] | None = None, cap: str | None = None) -> tuple[str, ...]:
    """The ISA levels the kernels are built for here, lowest first: each level needs the ones
    before it; `cap` (default: $PAGODA_CPU_ISA) stops at that level. () where even AVX2 is missing."""
    flags = cpu_flags() if flags is None else flags
    cap = os.environ.get("PAGODA_CPU_ISA") if cap is None else cap
    names = [name for name, _, _ in ISA_LEVELS]
    if cap and cap not in names:
        raise ValueError(f"PAGODA_CPU_ISA={cap!r}: expected one of {', '.join(names)}")
    levels: list[str] = []
    for name, needs, _ in ISA_LEVELS:
        if not set(needs) <= flags:
            break
        levels.append(name)
        if name == cap:
            break
    return tuple(levels)


def compiler_flags(isa: tuple[str, ...]) -> list[str]:
    enabled = [flag for name, _, flags in ISA_LEVELS if name in isa for flag in flags]
    return BASE_FLAGS + enabled


def load() -> ctypes.CDLL | None:
    """The compiled kernels, built on first use; None where they cannot run here."""
    return _load()[0]


def unavailable_reason() -> str | None:
    """Why load() gives None (for messages that say what is missing), or None where it does not."""
    return _load()[1]


@functools.cache
def _load() -> tuple[ctypes.CDLL | None, str | None]:
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None, "Pagoda's C kernels need Linux on x86-64"
    isa = cpu_isa()
    if not isa:
        return None, "Pagoda's C kernels need a CPU with AVX2 and FMA"
    compiler = shutil.which(os.environ.get("CC", "gcc"))
    if compiler is None:
        logger.warning("No C compiler found: Pagoda's CPU kernels are disabled (plain torch serves instead).")
        return None, "Pagoda's C kernels need a C compiler (gcc, or $CC), and none was found"
    flags = compiler_flags(isa)
    digest = hashlib.sha256(" ".join(flags).encode())
    for source in SOURCES:
        digest.update(source.name.encode() + source.read_bytes())
    target = cache_root() / "kernels" / f"cpu-{isa[-1]}-{digest.hexdigest()[:16]}.so"
    if not target.is_file():
        logger.info("Building Pagoda's CPU kernels for %s", "+".join(isa))
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            error = build_library(compiler, flags, [s for s in SOURCES if s.suffix == ".c"], built)
            if error is not None:
                logger.warning("Building Pagoda's CPU kernels failed: %s", error[-2000:])
                return None, "building Pagoda's C kernels failed (the compiler's error is in the log above)"
            os.replace(built, target)  # atomic: concurrent builders all end with one whole file
    lib = ctypes.CDLL(str(target))
    lib.isa = isa
    signatures = {**_VOID_SIGNATURES, **(_AMX_SIGNATURES if "amx" in isa else {})}
    for name, argtypes in signatures.items():
        getattr(lib, name).argtypes = argtypes
        getattr(lib, name).restype = None
    lib.pagoda_bind_threads.argtypes = [_P, ctypes.c_int]
    lib.pagoda_bind_threads.restype = ctypes.c_int
    lib.pagoda_amx_enable.restype = ctypes.c_int
    if "amx" in isa:
        lib.pagoda_bf16_tiles_size.argtypes = [_I64, _I64]
        lib.pagoda_bf16_tiles_size.restype = _I64
    lib.amx = "amx" in isa and lib.pagoda_amx_enable() == 1  # the OS grants the tile registers
    return lib, None


def build_library(compiler: str, flags: list[str], sources: list[Path], target: Path) -> str | None:
    """Compile each C source on its own, as many at once as there are CPUs, then link them into the
    shared library `target` (attention.c and qdot.c take two thirds of the time: on 2 cores of an
    AMD Zen 3 the build took 6.4 s so, 15 s as one command). The compiler's error output where a
    step failed, else None."""
    sources = sorted(sources, key=lambda s: -s.stat().st_size)  # longest first
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        objects = [str(Path(tmp) / f"{s.stem}.o") for s in sources]

        def compile_one(source_object: tuple[Path, str]) -> subprocess.CompletedProcess:
            source, obj = source_object
            return subprocess.run([compiler, *flags, "-c", str(source), "-o", obj], capture_output=True, text=True)

        with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            failed = [r.stderr.strip() for r in pool.map(compile_one, zip(sources, objects)) if r.returncode != 0]
        if failed:
            return "\n".join(failed)
        link = subprocess.run([compiler, *flags, *objects, "-o", str(target), "-lm"], capture_output=True, text=True)
    return link.stderr.strip() if link.returncode != 0 else None


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] whose rows may lie apart (a view of a fused projection), each row's heads
    contiguous, as the kernels read it."""
    return x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous()


def store_kv(
    lib: ctypes.CDLL,
    key: torch.Tensor,  # float32 [T, Hkv, D]
    value: torch.Tensor,
    kv_cache: torch.Tensor,  # float32 or bfloat16 [2, num_blocks, block_size, Hkv, D], contiguous
    slot_mapping: torch.Tensor,  # int64 [T], contiguous: each token's slot (block * block_size + offset)
) -> None:
    """Writes the tokens' keys and values to their slots, both in one call (a bfloat16 cache takes
    them rounded to the nearest bf16)."""
    key, value = _rows(key), _rows(value)
    lib.pagoda_store_kv(
        kv_cache[0].data_ptr(),
        kv_cache[1].data_ptr(),
        key.data_ptr(),
        key.stride(0),
        value.data_ptr(),
        value.stride(0),
        slot_mapping.data_ptr(),
        key.shape[0],
        key.shape[1] * key.shape[2],
        _is_bf16(kv_cache),
        torch.get_num_threads(),
    )


def paged_decode_attention(
    lib: ctypes.CDLL,
    out: torch.Tensor,  # float32 [B, H, D], contiguous: written
    query: torch.Tensor,  # float32 [B, H, D]
    key: torch.Tensor,  # float32 [B, Hkv, D]: the decodes' new keys, stored first
    value: torch.Tensor,
    kv_cache: torch.Tensor,  # float32 or bfloat16 [2, num_blocks, block_size, Hkv, D], contiguous
    slot_mapping: torch.Tensor,  # int64 [B], contiguous
    block_tables: torch.Tensor,  # int32 [B, max_blocks], contiguous
    seq_lens: torch.Tensor,  # int32 [B], each >= 1, counting the new token
    scale: float,
) -> None:
    """Stores the decodes' keys and values, then attends each over its paged cache in place (a
    bfloat16 cache's rows widened to float32 as they are read)."""
    query, key, value = _rows(query), _rows(key), _rows(value)
    batch, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    lib.pagoda_paged_decode_attention(
        out.data_ptr(),
        query.data_ptr(),
        query.stride(0),
        key.data_ptr(),
        key.stride(0),
        value.data_ptr(),
        value.stride(0),
        slot_mapping.data_ptr(),
        kv_cache[0].data_ptr(),
        kv_cache[1].data_ptr(),
        block_tables.data_ptr(),
        seq_lens.data_ptr(),
        batch,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        block_tables.shape[1],
        scale,
        _is_bf16(kv_cache),
        torch.get_num_threads(),
    )


def gemv(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [1, K] @ weight[N, K].T (+ bias): float32, contiguous, K % 8 == 0 -> [1, N]."""
    out = torch.empty(1, weight.shape[0])
    bias_ptr = None if bias is None else bias.data_ptr()
    lib.pagoda_gemv(
        weight.data_ptr(),
        x.data_ptr(),
        out.data_ptr(),
        bias_ptr,
        weight.shape[0],
        weight.shape[1],
        torch.get_num_threads(),
    )
    return out


def bind_threads(lib: ctypes.CDLL, cpus: list[int]) -> bool:
    """Pins thread i of the calling thread's compute team (torch's, of len(cpus) threads) to
    cpus[i]; False if any pin failed (e.g. a CPU outside this process's affinity)."""
    array = (ctypes.c_int * len(cpus))(*cpus)
    return lib.pagoda_bind_threads(ctypes.cast(array, _P), len(cpus)) == 0


def gemv_bf16(
    lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype
) -> torch.Tensor:
    """x [1, K] (bfloat16 or float32) @ weight[N, K].T (bfloat16) + bias (float32 or None), summed in
    float32 -> [1, N] of out_dtype (bfloat16 or float32). Contiguous, K % 8 == 0."""
    out = torch.empty(1, weight.shape[0], dtype=out_dtype)
    lib.pagoda_gemv_bf16(
        weight.data_ptr(),
        x.data_ptr(),
        x.dtype == torch.bfloat16,
        out.data_ptr(),
        out_dtype == torch.bfloat16,
        None if bias is None else bias.data_ptr(),
        weight.shape[0],
        weight.shape[1],
        torch.get_num_threads(),
    )
    return out


def pack_bf16_tiles(lib: ctypes.CDLL, weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] bfloat16 (K % 32 == 0) packed into AMX's B tiles for gemm_bf16 (csrc/bf16.c)."""
    weight = weight.contiguous()
    n, k = weight.shape
    out = torch.empty(lib.pagoda_bf16_tiles_size(n, k), dtype=torch.bfloat16)
    lib.pagoda_bf16_pack_tiles(out.data_ptr(), weight.data_ptr(), n, k, torch.get_num_threads())
    return out


def gemm_bf16(
    lib: ctypes.CDLL, x: torch.Tensor, tiles: torch.Tensor, bias: torch.Tensor | None, n: int
) -> torch.Tensor:
    """x [M, K] bfloat16 @ the packed weight's [N, K].T + bias (float32 or None) on AMX, summed in
    float32 and rounded to bfloat16 once -> [M, N] bfloat16. Only where lib.amx."""
    x = x.contiguous()
    m, k = x.shape
    out = torch.empty(m, n, dtype=torch.bfloat16)
    lib.pagoda_gemm_bf16(
        out.data_ptr(),
        x.data_ptr(),
        tiles.data_ptr(),
        None if bias is None else bias.data_ptr(),
        m,
        n,
        k,
        torch.get_num_threads(),
    )
    return out


# The fused kernels (csrc/fused.c) take float32 or bfloat16 tensors, as torch computes each dtype.
FUSED_DTYPES = (torch.float32, torch.bfloat16)


def _is_bf16(x: torch.Tensor) -> int:
    assert x.dtype in FUSED_DTYPES, x.dtype
    return int(x.dtype == torch.bfloat16)


def rms_norm(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rmsnorm(x) * weight over the rows of x [T, n]: contiguous, weight in x's dtype."""
    out = torch.empty_like(x)
    lib.pagoda_rms_norm(
        out.data_ptr(),
        x.data_ptr(),
        weight.data_ptr(),
        x.shape[0],
        x.shape[1],
        eps,
        _is_bf16(x),
        torch.get_num_threads(),
    )
    return out


def add_rms_norm(lib: ctypes.CDLL, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place: residual += x, then x = rmsnorm(residual) * weight; all of one dtype, [T, n] contiguous."""
    lib.pagoda_add_rms_norm(
        x.data_ptr(),
        residual.data_ptr(),
        weight.data_ptr(),
        x.shape[0],
        x.shape[1],
        eps,
        _is_bf16(x),
        torch.get_num_threads(),
    )


def rotary(
    lib: ctypes.CDLL,
    x: torch.Tensor,  # [T, heads, D]: heads contiguous within a token, tokens any stride apart
    cos: torch.Tensor,  # [max_positions, D] in x's dtype, contiguous
    signed_sin: torch.Tensor,  # [max_positions, D] in x's dtype, contiguous, first half negated
    positions: torch.Tensor,  # int64 [T], contiguous, each < max_positions
) -> None:
    """Rotary embedding applied to x in place, HF's rotate-half convention."""
    tokens, heads, head_dim = x.shape
    lib.pagoda_rotary(
        x.data_ptr(),
        cos.data_ptr(),
        signed_sin.data_ptr(),
        positions.data_ptr(),
        tokens,
        heads,
        head_dim,
        x.stride(0),
        _is_bf16(x),
        torch.get_num_threads(),
    )


def silu_mul(lib: ctypes.CDLL, gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up from gate_up [T, 2n] = [gate | up] (contiguous) -> [T, n] in its dtype."""
    rows, width = gate_up.shape
    out = torch.empty(rows, width // 2, dtype=gate_up.dtype)
    lib.pagoda_silu_mul(
        out.data_ptr(), gate_up.data_ptr(), rows, width // 2, _is_bf16(gate_up), torch.get_num_threads()
    )
    return out


def gemm_invariant_groups(
    lib: ctypes.CDLL, x: torch.Tensor, packed: torch.Tensor, row0: torch.Tensor, sizes: torch.Tensor, n: int
) -> torch.Tensor:
    """gemm_invariant over consecutive groups of x's rows [M, K] (float32, contiguous), group g's
    `sizes[g]` rows from row `row0[g]` on by the weight whose pack_panels tensor is at address
    `packed[g]` (int64 tensors), without bias -> [M, n]: each row's outputs the bits of
    gemm_invariant on it."""
    m, k = x.shape
    x = x.contiguous()
    out = torch.empty(m, n)
    lib.pagoda_gemm_invariant_groups(
        out.data_ptr(),
        n,
        x.data_ptr(),
        k,
        packed.data_ptr(),
        row0.data_ptr(),
        sizes.data_ptr(),
        len(sizes),
        n,
        k,
        torch.get_num_threads(),
    )
    return out


def sample_rows(
    lib: ctypes.CDLL,
    logits: torch.Tensor,  # float32 or bfloat16 [B, V], contiguous
    temperature: torch.Tensor,  # float32 [B]: 0 greedy, else the row's temperature
    uniforms: torch.Tensor,  # float64 [B] in [0, 1): the random rows' draws
) -> torch.Tensor:
    """A token per row (int64 [B]) for plain greedy and plain random rows (sample.c): the greedy
    row's argmax, the random row's draw by sampler.draw's rule; -1 where the row has a NaN or no
    finite positive total, for the caller to take the torch way."""
    tokens = torch.empty(logits.shape[0], dtype=torch.int64)
    lib.pagoda_sample_rows(
        logits.data_ptr(),
        logits.shape[0],
        logits.shape[1],
        _is_bf16(logits),
        temperature.data_ptr(),
        uniforms.data_ptr(),
        tokens.data_ptr(),
        torch.get_num_threads(),
    )
    return tokens


def prefill_attention(
    lib: ctypes.CDLL,
    out: torch.Tensor,  # float32 [T, H, D], contiguous: written
    query: torch.Tensor,  # float32 [T, H, D]
    kv_cache: torch.Tensor,  # float32 or bfloat16 [2, num_blocks, block_size, Hkv, D], contiguous, chunks' KV stored
    block_tables: torch.Tensor,  # int32 [R, max_blocks], contiguous
    query_start: torch.Tensor,  # int32 [R + 1], contiguous: request i owns rows query_start[i] .. [i + 1] - 1
    seq_lens: torch.Tensor,  # int32 [R], contiguous: each request's tokens, its chunk's last included
    scale: float,
) -> None:
    """Causal attention of prefill chunks over their paged cache in place, each row computed as a
    decode at its position computes it (paged_decode_attention): bitwise the same."""
    query = _rows(query)
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    lib.pagoda_prefill_attention(
        out.data_ptr(),
        query.data_ptr(),
        query.stride(0),
        kv_cache[0].data_ptr(),
        kv_cache[1].data_ptr(),
        block_tables.data_ptr(),
        query_start.data_ptr(),
        seq_lens.data_ptr(),
        seq_lens.shape[0],
        query.shape[1],
        num_kv_heads,
        head_dim,
        block_size,
        block_tables.shape[1],
        scale,
        _is_bf16(kv_cache),
        torch.get_num_threads(),
    )


PANEL = 16  # output columns per packed panel (csrc/gemm.c)


def pack_panels(lib: ctypes.CDLL, weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] (float32, contiguous) in gemm_invariant's layout: ceil(N / 16) panels of
    [K, 16], k-major, the columns past N zero."""
    n, k = weight.shape
    out = torch.empty(-(-n // PANEL), k, PANEL)
    lib.pagoda_pack_panels(out.data_ptr(), weight.data_ptr(), n, k, torch.get_num_threads())
    return out


def gemm_invariant(
    lib: ctypes.CDLL, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int
) -> torch.Tensor:
    """x [M, K] (float32, rows contiguous) @ weight.T (+ bias [N]) -> [M, N] from pack_panels(weight),
    each output summed over k in order whatever M is (batch-invariant)."""
    m, k = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(m, n)
    lib.pagoda_gemm_invariant(
        out.data_ptr(),
        n,
        x.data_ptr(),
        x.stride(0),
        packed.data_ptr(),
        None if bias is None else bias.data_ptr(),
        m,
        n,
        k,
        torch.get_num_threads(),
    )
    return out
