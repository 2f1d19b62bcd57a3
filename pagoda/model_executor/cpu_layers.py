"""The small ops of a decoder layer on the CPU in float32 and bfloat16, each one call into Pagoda's C kernels
(csrc/fused.c) instead of several torch dispatches: the residual add fused into the norm after it,
Qwen3's per-head q/k norms, rotary embedding in place on the query and key heads, SiLU(gate) * up.

At load, `convert_model` swaps the model's ResidualRMSNorm, RMSNorm, SiluAndMul and RotaryEmbedding
modules for the ones here, sharing their weights and tables. Norm and rotation write in place:
the residual stream, the sublayer output a norm is given and the heads a rotation is given must be
tensors no one else holds, which the decoder's are (fresh projection outputs, the embedding
lookup, and q/k norm outputs).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
from torch import nn

from pagoda.kernels import cpu
from pagoda.model_executor.layers import ResidualRMSNorm, RMSNorm, RotaryEmbedding, SiluAndMul, replace_modules


def supported(dtype: torch.dtype, device: torch.device) -> bool:
    return device.type == "cpu" and dtype in cpu.FUSED_DTYPES


class CpuResidualRMSNorm(nn.Module):
    """ResidualRMSNorm by the C kernels: the stream is added to in place, and the sum normalized
    into `x`'s storage."""

    def __init__(self, norm: ResidualRMSNorm, lib: ctypes.CDLL) -> None:
        super().__init__()
        self.weight, self.eps, self.lib = norm.weight, norm.eps, lib

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return cpu.rms_norm(self.lib, x, self.weight, self.eps), x
        cpu.add_rms_norm(self.lib, x, residual, self.weight, self.eps)
        return x, residual


class CpuRMSNorm(nn.Module):
    """RMSNorm over the last dimension by the C kernel, out of place on a contiguous copy (q/k norms
    get views of the fused qkv projection)."""

    def __init__(self, norm: RMSNorm, lib: ctypes.CDLL) -> None:
        super().__init__()
        self.weight, self.eps, self.lib = norm.weight, norm.eps, lib

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        return cpu.rms_norm(self.lib, rows, self.weight, self.eps).view(x.shape)


class CpuSiluAndMul(nn.Module):
    def __init__(self, lib: ctypes.CDLL) -> None:
        super().__init__()
        self.lib = lib

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        return cpu.silu_mul(self.lib, gate_up)


@dataclass(frozen=True)
class CpuRotation:
    """Rotates heads in place by the C kernel, reading each token's angles from the full tables."""

    lib: ctypes.CDLL
    cos: torch.Tensor  # [max_positions, D]
    signed_sin: torch.Tensor  # [max_positions, D]
    positions: torch.Tensor  # int64 [T]

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        cpu.rotary(self.lib, x, self.cos, self.signed_sin, self.positions)
        return x


class CpuRotaryEmbedding(nn.Module):
    """RotaryEmbedding's tables, looked up by the C kernel: a step gathers nothing."""

    def __init__(self, rotary: RotaryEmbedding, lib: ctypes.CDLL) -> None:
        super().__init__()
        self.register_buffer("cos", rotary.cos, persistent=False)
        self.register_buffer("signed_sin", rotary.signed_sin, persistent=False)
        self.lib = lib

    def lookup(self, positions: torch.Tensor) -> CpuRotation:
        return CpuRotation(self.lib, self.cos, self.signed_sin, positions.to(torch.int64).contiguous())


def convert_model(model: nn.Module) -> bool:
    """A DecoderModel's norms, activations and rotary embedding swapped for the C kernels' in
    place; False (nothing changed) where the kernels cannot be built."""
    lib = cpu.load()
    if lib is None:
        return False
    replace_modules(model, ResidualRMSNorm, lambda norm: CpuResidualRMSNorm(norm, lib))
    replace_modules(model, RMSNorm, lambda norm: CpuRMSNorm(norm, lib))
    replace_modules(model, SiluAndMul, lambda _: CpuSiluAndMul(lib))
    replace_modules(model, RotaryEmbedding, lambda rotary: CpuRotaryEmbedding(rotary, lib))
    return True
