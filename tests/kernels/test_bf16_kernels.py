"""The bfloat16 kernels (csrc/bf16.c) against straightforward torch in float32 on the same bf16
values, on every code path this CPU can take: PAGODA_CPU_ISA caps the build at AVX2 (bf16 widened
by shifts, 8 lanes), AVX-512 (16 lanes) and, uncapped, AVX512-BF16 (dpbf16) where present; the
GEMM on AMX tiles where the CPU and OS give them."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from pagoda.kernels import cpu as cpu_kernels

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="the C kernels cannot be built on this machine")
LEVELS = ["avx2", "avx512", "avx512_bf16"]


@pytest.fixture(params=LEVELS)
def lib(request, monkeypatch) -> Iterator:
    if request.param not in cpu_kernels.cpu_isa(cap=request.param):
        pytest.skip(f"this CPU lacks {request.param}")
    monkeypatch.setenv("PAGODA_CPU_ISA", request.param)
    cpu_kernels._load.cache_clear()
    try:
        built = cpu_kernels.load()
        assert built is not None and built.isa[-1] == request.param
        yield built
    finally:
        cpu_kernels._load.cache_clear()


def assert_bf16_close(out: torch.Tensor, exact: torch.Tensor) -> None:
    """`out` is `exact` rounded to bf16, give or take one bf16 step: fp32 sums in another order may
    fall on the other side of a rounding boundary."""
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), exact, atol=1e-3, rtol=2**-7)


@pytest.mark.parametrize("n_out,k", [(4, 8), (7, 24), (160, 96), (1000, 584), (3072, 576)])
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
def test_gemv_bf16_matches_fp32_math(lib, n_out, k, x_dtype):
    """Rows in and out of the 4-row blocks; k with tails of 8, 16 and 24 past whole cache lines."""
    gen = torch.Generator().manual_seed(n_out * k)
    weight = torch.randn(n_out, k, generator=gen).bfloat16()
    x, bias = torch.randn(1, k, generator=gen).to(x_dtype), torch.randn(n_out, generator=gen)
    exact = F.linear(x.double(), weight.double(), bias.double()).float()
    torch.testing.assert_close(cpu_kernels.gemv_bf16(lib, x, weight, bias, torch.float32), exact, atol=1e-4, rtol=1e-5)
    assert_bf16_close(cpu_kernels.gemv_bf16(lib, x, weight, None, torch.bfloat16), exact - bias)


def test_gemv_bf16_keeps_fp32_activations_exact(lib):
    """An fp32 x is not rounded to bf16 on the way in: x = 1 + 2^-12 differs from its bf16 (1)."""
    weight = torch.ones(8, 16, dtype=torch.bfloat16)
    x = torch.full((1, 16), 1 + 2**-12)
    out = cpu_kernels.gemv_bf16(lib, x, weight, None, torch.float32)
    torch.testing.assert_close(out, torch.full((1, 8), 16 * (1 + 2**-12)), atol=0, rtol=0)


needs_amx = pytest.mark.skipif(
    cpu_kernels.load() is None or not cpu_kernels.load().amx, reason="this CPU (or its OS) gives no AMX tiles"
)


@needs_amx
@pytest.mark.parametrize("m", [2, 15, 16, 17, 32, 33, 47, 300])
@pytest.mark.parametrize("n,k", [(16, 32), (40, 96), (96, 576), (200, 1536)])
def test_gemm_bf16_on_tiles_matches_fp32_math(m, n, k):
    """Rows in whole pairs of 16-row tiles, a single one, a partial last one (copied into zeroed
    rows) and past the 256-row chunks; columns in whole panel pairs, an odd last panel and a
    partial one; k of one to 48 tile blocks; a strided x."""
    lib = cpu_kernels.load()
    gen = torch.Generator().manual_seed(m * n + k)
    weight, x = torch.randn(n, k, generator=gen).bfloat16(), torch.randn(m, k, generator=gen).bfloat16()
    bias = torch.randn(n, generator=gen)
    tiles = cpu_kernels.pack_bf16_tiles(lib, weight)
    exact = F.linear(x.double(), weight.double(), bias.double()).float()
    assert_bf16_close(cpu_kernels.gemm_bf16(lib, x, tiles, bias, n), exact)
    strided = torch.cat([x, x], dim=1)[:, :k]
    assert_bf16_close(cpu_kernels.gemm_bf16(lib, strided, tiles, None, n), exact - bias)


@needs_amx
def test_gemm_bf16_rounds_each_output_once():
    """Sums exact in fp32 come out as their bf16 rounding (to nearest even), with no rounding on
    the way: 1 + 2^-8 (a tie between bf16 neighbours 1 and 1 + 2^-7) rounds to 1, and
    1 + 3 * 2^-8 to 1 + 2^-6."""
    lib = cpu_kernels.load()
    weight = torch.zeros(16, 32, dtype=torch.bfloat16)
    weight[:, 0], weight[:, 1] = 1, 2**-8
    x = torch.zeros(2, 32, dtype=torch.bfloat16)
    x[0, :2] = 1
    x[1, 0], x[1, 1] = 1, 3
    out = cpu_kernels.gemm_bf16(lib, x, cpu_kernels.pack_bf16_tiles(lib, weight), None, 16)
    assert out[0].tolist() == [1.0] * 16
    assert out[1].tolist() == [1 + 2**-6] * 16
