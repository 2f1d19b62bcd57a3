"""The fused C kernels (csrc/fused.c) against the torch formulas they replace, on random inputs:
row counts on both sides of the threading threshold, lengths with and without a part vector, built
for this CPU and capped at AVX2."""

from __future__ import annotations

import ctypes

import pytest
import torch
import torch.nn.functional as F

from pagoda.kernels import cpu as cpu_kernels
from pagoda.model_executor.layers import apply_rotary

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="the C kernels cannot be built on this machine")

ROWS = [1, 3, 64, 600]  # 600 rows of 576 floats and more are split across threads


@pytest.fixture(params=["native", "avx2"])
def lib(request, monkeypatch) -> ctypes.CDLL:
    if request.param == "avx2":
        monkeypatch.setenv("PAGODA_CPU_ISA", "avx2")
    cpu_kernels.load.cache_clear()
    lib = cpu_kernels.load()
    assert lib is not None and (request.param == "native" or lib.isa[-1] == "avx2")
    yield lib
    cpu_kernels.load.cache_clear()


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("n", [8, 24, 576, 584, 1000, 13])
def test_rms_norm_matches_torch(lib, rows, n):
    x, weight = randn(rows, n, seed=rows * n), randn(n, seed=1)
    out = cpu_kernels.rms_norm(lib, x, weight, 1e-6)
    torch.testing.assert_close(out, F.rms_norm(x, (n,), weight, 1e-6))


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("n", [8, 24, 576, 584, 1000, 13])
def test_add_rms_norm_matches_torch(lib, rows, n):
    x, residual, weight = randn(rows, n, seed=rows * n), randn(rows, n, seed=2) * 4, randn(n, seed=3)
    expected_residual = residual + x
    expected = F.rms_norm(expected_residual, (n,), weight, 1e-5)
    cpu_kernels.add_rms_norm(lib, x, residual, weight, 1e-5)
    torch.testing.assert_close(residual, expected_residual, rtol=0, atol=0)  # one float add: exact
    torch.testing.assert_close(x, expected)


@pytest.mark.parametrize("tokens", ROWS)
@pytest.mark.parametrize("head_dim", [64, 128, 80, 24])
def test_rotary_in_place_on_qkv_matches_apply_rotary(lib, tokens, head_dim):
    """q and k heads rotated where they lie in a fused qkv output (tokens a qkv row apart); the v
    heads after them are left alone."""
    num_heads, num_kv_heads, max_positions = 6, 2, 4096
    qk_heads = num_heads + num_kv_heads
    qkv = randn(tokens, (qk_heads + num_kv_heads) * head_dim, seed=tokens * head_dim)
    angles = randn(max_positions, head_dim // 2, seed=4)
    cos = torch.cat((angles.cos(), angles.cos()), dim=-1)
    signed_sin = torch.cat((-angles.sin(), angles.sin()), dim=-1)
    positions = torch.randint(0, max_positions, (tokens,), generator=torch.Generator().manual_seed(5))
    qk = qkv[:, : qk_heads * head_dim].view(tokens, qk_heads, head_dim)
    expected = apply_rotary(qk, cos[positions].unsqueeze(1), signed_sin[positions].unsqueeze(1))
    v_before = qkv[:, qk_heads * head_dim :].clone()

    cpu_kernels.rotary(lib, qk, cos, signed_sin, positions)
    torch.testing.assert_close(qk, expected)
    assert torch.equal(qkv[:, qk_heads * head_dim :], v_before)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("n", [8, 24, 1536, 1000, 13])
def test_silu_mul_matches_torch(lib, rows, n):
    """Gates from -100 to 100: e^-g at both ends of float's range."""
    gate_up = randn(rows, 2 * n, seed=rows * n) * 3
    gate_up[0, :n] = torch.linspace(-100, 100, n)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(cpu_kernels.silu_mul(lib, gate_up), F.silu(gate) * up)
