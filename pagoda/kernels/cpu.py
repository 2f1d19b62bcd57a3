"""Builds and binds cpu.c: compiled once per source version with the system C compiler into
Pagoda's cache, loaded with ctypes. Where it cannot be built (no compiler, not x86-64 with AVX2 and
FMA), `load()` returns None and callers keep to plain torch.
"""

from __future__ import annotations

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

SOURCE = Path(__file__).with_name("cpu.c")
FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC"]
_P, _I64 = ctypes.c_void_p, ctypes.c_long


@functools.cache
def load() -> ctypes.CDLL | None:
    """The compiled kernels, built on first use; None where they cannot run here."""
    if not _cpu_supported():
        return None
    compiler = shutil.which(os.environ.get("CC", "gcc"))
    if compiler is None:
        logger.warning("No C compiler found: Pagoda's CPU kernels are disabled (plain torch serves instead).")
        return None
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join(FLAGS).encode()).hexdigest()[:16]
    target = cache_root() / "kernels" / f"cpu-{key}.so"
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            result = subprocess.run(
                [compiler, *FLAGS, str(SOURCE), "-o", str(built), "-lm"], capture_output=True, text=True
            )
            if result.returncode != 0:
                logger.warning("Building Pagoda's CPU kernels failed: %s", result.stderr.strip()[-2000:])
                return None
            os.replace(built, target)  # atomic: concurrent builders all end with one whole file
    lib = ctypes.CDLL(str(target))
    lib.pagoda_paged_decode_attention.argtypes = [_P] * 6 + [_I64] * 6 + [ctypes.c_float, ctypes.c_int]
    lib.pagoda_paged_decode_attention.restype = None
    lib.pagoda_gemv.argtypes = [_P] * 4 + [_I64] * 2 + [ctypes.c_int]
    lib.pagoda_gemv.restype = None
    return lib


def _cpu_supported() -> bool:
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        flags = next(
            line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")
        ).split()
    except (OSError, StopIteration):
        return False
    return "avx2" in flags and "fma" in flags


def paged_decode_attention(
    lib: ctypes.CDLL,
    query: torch.Tensor,  # float32 [B, H, D]
    k_cache: torch.Tensor,  # float32 [num_blocks, block_size, Hkv, D], contiguous
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # int32 [B, max_blocks], contiguous
    seq_lens: torch.Tensor,  # int32 [B], each >= 1
    scale: float,
) -> torch.Tensor:
    """Decode attention read in place from the paged cache: [B, H, D]."""
    query = query.contiguous()
    batch, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    out = torch.empty_like(query)
    lib.pagoda_paged_decode_attention(
        out.data_ptr(),
        query.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_tables.data_ptr(),
        seq_lens.data_ptr(),
        batch,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        block_tables.shape[1],
        scale,
        torch.get_num_threads(),
    )
    return out


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
