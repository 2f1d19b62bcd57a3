"""The small ops of a decoder layer on a GPU in bfloat16 and float16, each one Triton kernel instead
of several torch ones: the residual add fused into the norm after it, SiLU(gate) * up, the rotary
embedding with its table lookup, and fp8's per-token activation quantization.

In torch's ops these were some 20 kernels a layer, and eight a linear for fp8's quantization, each
a few microseconds however little it computes (what that costs a decode: docs/gpu.md).

Each kernel rounds where torch's ops round, so that its results are torch's: the residual sum,
the normalized row and its product with the weight; SiLU's result and its product with up; each of
rotation's two products and their sum; fp8's scale (the reciprocal's product, as torch divides by
a number on a GPU) and codes (an IEEE division). Where they may differ: the norm sums its squares
in another order and SiLU takes Triton's exponential, which can move the normalized row's or
SiLU's rounding by one representable value (two in its product): on an H200 at Llama-3-8B's
widths, never in bfloat16, in up to 0.02% of the elements in float16. float32 keeps torch's ops
(the GPU's float32 checks compare with transformers op for op).

At load, `convert_model` swaps the model's modules for the ones here, sharing their weights and
tables. Nothing here imports on a CPU-only path: Triton is loaded by the loader only for a GPU
model (tests run the kernels on CPU tensors under TRITON_INTERPRET=1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import nn

from pagoda.model_executor.layers import ResidualRMSNorm, RotaryEmbedding, SiluAndMul, replace_modules
from pagoda.model_executor.quantization import FP8, FP8_MAX, MIN_SCALE, Fp8Linear

DTYPES = (torch.bfloat16, torch.float16)
ROTARY_HEADS = 16  # heads a rotary program takes: a few thousand values, however many heads the model has


def supported(dtype: torch.dtype, device: torch.device) -> bool:
    return device.type == "cuda" and dtype in DTYPES


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    sum_ptr,
    n,
    inv_n,
    x_stride,
    res_stride,
    eps,
    HAS_RES: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One row: s = residual + x (rounded, stored as the new stream), then w * (s * rsqrt(mean(s^2) + eps)),
    the mean the sum times 1 / n (float32) as torch's GPU mean takes it."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    dtype = out_ptr.dtype.element_ty
    s = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        r = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0).to(tl.float32)
        s = (r + s).to(dtype)
        tl.store(sum_ptr + row * n + cols, s, mask=mask)
        s = s.to(tl.float32)
    variance = tl.sum(s * s, axis=0) * inv_n
    y = (s * tl.math.rsqrt(variance + eps)).to(dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n + cols, (w * y).to(dtype), mask=mask)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x) for x, residual [T, n] with unit column stride; with
    no residual, (rms_norm(x), x)."""
    rows, n = x.shape
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    stream = x if residual is None else torch.empty_like(out)
    if rows:
        _add_rms_norm_kernel[(rows,)](
            x,
            x if residual is None else residual,
            weight,
            out,
            stream,
            n,
            1 / n,
            x.stride(0),
            x.stride(0) if residual is None else residual.stride(0),
            eps,
            HAS_RES=residual is not None,
            BLOCK=triton.next_power_of_2(n),
            num_warps=_warps(n),
        )
    return out, stream


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, n, stride, BLOCK: tl.constexpr):
    """out[row, i] = silu(gate[i]) * up[i], gate_up's row = [gate | up], each product rounded as torch's."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    dtype = out_ptr.dtype.element_ty
    g = tl.load(gate_up_ptr + row * stride + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gate_up_ptr + row * stride + n + cols, mask=mask, other=0.0).to(tl.float32)
    silu = tl.math.div_rn(g, 1.0 + tl.exp(-g)).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * n + cols, (silu * u).to(dtype), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] = [gate | up] (unit column stride) -> silu(gate) * up [T, I]."""
    rows, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((rows, n), dtype=gate_up.dtype, device=gate_up.device)
    block = min(triton.next_power_of_2(n), 2048)
    if rows:
        _silu_mul_kernel[(rows, triton.cdiv(n, block))](gate_up, out, n, gate_up.stride(0), BLOCK=block, num_warps=4)
    return out


@triton.jit
def _rotary_kernel(
    x_ptr,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    heads,
    d,
    x_stride_t,
    x_stride_h,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Token t's heads h of block program_id(1): out = x * cos + x.roll(d / 2) * signed_sin at its
    position, each product and the sum rounded as torch's."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]
    i = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < heads) & (i < d)
    dtype = out_ptr.dtype.element_ty
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cos = tl.load(cos_ptr + pos * d + i, mask=i < d, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + pos * d + i, mask=i < d, other=0.0).to(tl.float32)
    row = x_ptr + t * x_stride_t + h * x_stride_h
    x = tl.load(row + i, mask=mask, other=0.0).to(tl.float32)
    rolled = tl.load(row + (i + d // 2) % d, mask=mask, other=0.0).to(tl.float32)
    a = (x * cos).to(dtype).to(tl.float32)
    b = (rolled * sin).to(dtype).to(tl.float32)
    tl.store(out_ptr + (t * heads + h) * d + i, (a + b).to(dtype), mask=mask)


def rotate(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] (unit stride in D) rotated by each token's angles in the tables [P, D]: a new
    contiguous tensor, apply_rotary's values."""
    tokens, heads, d = x.shape
    out = torch.empty((tokens, heads, d), dtype=x.dtype, device=x.device)
    if tokens:
        block_h = min(triton.next_power_of_2(heads), ROTARY_HEADS)
        _rotary_kernel[(tokens, triton.cdiv(heads, block_h))](
            x,
            positions,
            cos,
            signed_sin,
            out,
            heads,
            d,
            x.stride(0),
            x.stride(1),
            BLOCK_H=block_h,
            BLOCK_D=triton.next_power_of_2(d),
            num_warps=4,
        )
    return out


@triton.jit
def _quantize_fp8_kernel(x_ptr, q_ptr, scale_ptr, n, stride, fp8_max, inv_fp8_max, min_scale, BLOCK: tl.constexpr):
    """One row: scale = max(amax|x| * (1 / fp8_max), min_scale), q = clamp(x / scale) as float8 e4m3."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * stride + cols, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=0) * inv_fp8_max, min_scale)
    q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -fp8_max), fp8_max)
    tl.store(q_ptr + row * n + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row, scale)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantization.quantize_per_token in one kernel: x [T, n] -> (float8 [T, n], float32 scale [T, 1])."""
    rows, n = x.shape
    q = torch.empty((rows, n), dtype=FP8, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows:
        _quantize_fp8_kernel[(rows,)](
            x,
            q,
            scale,
            n,
            x.stride(0),
            FP8_MAX,
            1 / FP8_MAX,
            MIN_SCALE,
            BLOCK=triton.next_power_of_2(n),
            num_warps=_warps(n),
        )
    return q, scale


def _warps(n: int) -> int:
    """Warps for a kernel with one program per row of n values: about 8 values a thread per load."""
    return max(1, min(16, triton.next_power_of_2(n) // 256))


class GpuResidualRMSNorm(nn.Module):
    def __init__(self, norm: ResidualRMSNorm) -> None:
        super().__init__()
        self.weight, self.eps = norm.weight, norm.eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        return add_rms_norm(x, residual, self.weight, self.eps)


class GpuSiluAndMul(nn.Module):
    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(gate_up)


@dataclass(frozen=True)
class GpuRotation:
    """Rotates heads by the kernel, reading each token's angles from the full tables."""

    cos: torch.Tensor  # [max_positions, D]
    signed_sin: torch.Tensor  # [max_positions, D]
    positions: torch.Tensor  # [T]

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return rotate(x, self.positions, self.cos, self.signed_sin)


class GpuRotaryEmbedding(nn.Module):
    """RotaryEmbedding's tables, looked up by the kernel: a step gathers nothing."""

    def __init__(self, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.register_buffer("cos", rotary.cos, persistent=False)
        self.register_buffer("signed_sin", rotary.signed_sin, persistent=False)

    def lookup(self, positions: torch.Tensor) -> GpuRotation:
        return GpuRotation(self.cos, self.signed_sin, positions)


def convert_model(model: nn.Module) -> None:
    """A DecoderModel's residual norms, activations and rotary embedding swapped for the kernels'
    in place (Qwen3's per-head q/k norms keep torch's ops); its fp8 linears quantize their
    activations by the kernel."""
    replace_modules(model, ResidualRMSNorm, GpuResidualRMSNorm)
    replace_modules(model, SiluAndMul, lambda _: GpuSiluAndMul())
    replace_modules(model, RotaryEmbedding, GpuRotaryEmbedding)
    for module in model.modules():
        if isinstance(module, Fp8Linear):
            module.quantize_activations = quantize_per_token
