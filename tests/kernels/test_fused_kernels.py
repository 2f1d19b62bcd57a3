"""The fused C kernels (csrc/fused.c) against the torch formulas they replace, on random inputs:
row counts on both sides of the threading threshold, lengths with and without a part vector, built
for this CPU and capped at AVX2."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagoda.kernels import cpu as cpu_kernels
from pagoda.model_executor.layers import SiluAndMul, apply_rotary, rms_norm

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="the C kernels cannot be built on this machine")

ROWS = [1, 3, 64, 600]  # from 29 rows of 576 floats the rows are split across threads


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


def assert_bf16_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """bf16 tensors equal but for values one bf16 step apart (a sum of squares or an exponential
    computed in another order can round the other way) and values below 1e-30 (silu(g) for
    g < -87, where e^-g is beyond float's range); nearly all values equal."""
    assert actual.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(actual.float(), expected.float(), rtol=2**-7, atol=1e-30)
    normal = expected.float().abs() > 1e-30
    assert (actual == expected)[normal].float().mean().item() > 0.95


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("n", [8, 24, 576, 1000, 13])
def test_bf16_add_rms_norm_and_rms_norm_match_torch_layers(lib, rows, n):
    """The residual add is one rounded add in bf16 (bitwise torch's); the norm differs from torch's
    layer by at most one bf16 step."""
    x = randn(rows, n, seed=rows * n).bfloat16()
    residual, weight = (randn(rows, n, seed=2) * 4).bfloat16(), randn(n, seed=3).bfloat16()
    expected_residual = residual + x
    expected = rms_norm(expected_residual, weight, 1e-5)
    assert_bf16_close(cpu_kernels.rms_norm(lib, expected_residual, weight, 1e-5), expected)
    cpu_kernels.add_rms_norm(lib, x, residual, weight, 1e-5)
    assert torch.equal(residual, expected_residual)
    assert_bf16_close(x, expected)


@pytest.mark.parametrize("tokens", [1, 3, 600])
@pytest.mark.parametrize("head_dim", [64, 80, 24])
def test_bf16_rotary_equals_apply_rotary(lib, tokens, head_dim):
    """Each bf16 product and their sum rounded as torch rounds them: bitwise equal."""
    heads, max_positions = 8, 4096
    angles = randn(max_positions, head_dim // 2, seed=4)
    cos = torch.cat((angles.cos(), angles.cos()), dim=-1).bfloat16()
    signed_sin = torch.cat((-angles.sin(), angles.sin()), dim=-1).bfloat16()
    positions = torch.randint(0, max_positions, (tokens,), generator=torch.Generator().manual_seed(5))
    x = randn(tokens, heads, head_dim, seed=tokens * head_dim).bfloat16()
    expected = apply_rotary(x, cos[positions].unsqueeze(1), signed_sin[positions].unsqueeze(1))
    cpu_kernels.rotary(lib, x, cos, signed_sin, positions)
    assert torch.equal(x, expected)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("n", [8, 24, 1536, 13])
def test_bf16_silu_mul_matches_torch(lib, rows, n):
    gate_up = (randn(rows, 2 * n, seed=rows * n) * 3).bfloat16()
    gate_up[0, :n] = torch.linspace(-100, 100, n).bfloat16()
    assert_bf16_close(cpu_kernels.silu_mul(lib, gate_up), SiluAndMul()(gate_up))


def test_bf16_rounding_is_torchs(lib):
    """silu(g) * 1 in bf16 is silu(g) rounded: ties to even, past bf16's largest value to infinity,
    subnormals kept, NaNs (quiet, signalling, negative) stay NaN."""
    gate = torch.tensor([1.00390625, 1.01171875, 3.3895e38, -0.0, 1e-40, 0.0, 0.0, 0.0])
    gate.view(torch.int32)[5:] = torch.tensor([0x7F800001, 0x7FC00000, -0x7FFF], dtype=torch.int32)
    gate_up = torch.cat((gate, torch.ones_like(gate))).reshape(1, -1)
    out = cpu_kernels.silu_mul(lib, gate_up.bfloat16())
    assert torch.equal(out[:, :5], SiluAndMul()(gate_up.bfloat16())[:, :5]) and out[:, 5:].isnan().all()
