"""The bfloat16 kernels (csrc/bf16.c) against straightforward torch in float32 on the same bf16
values, on every code path this CPU can take: PAGODA_CPU_ISA caps the build at AVX2 (bf16 widened
by shifts, 8 lanes), AVX-512 (16 lanes) and, uncapped, AVX512-BF16 (dpbf16) where present."""

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
    cpu_kernels.load.cache_clear()
    try:
        built = cpu_kernels.load()
        assert built is not None and built.isa[-1] == request.param
        yield built
    finally:
        cpu_kernels.load.cache_clear()


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
