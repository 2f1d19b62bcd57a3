"""Building blocks of decoder-only transformers, computed exactly as Hugging Face computes them."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def empty_param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class Linear(nn.Module):
    """A linear layer without initialization (weights are loaded)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype, device) -> None:
        super().__init__()
        self.weight = empty_param(out_features, in_features, dtype=dtype, device=device)
        self.bias = empty_param(out_features, dtype=dtype, device=device) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def replace_linears(model: nn.Module, make) -> int:
    """Replace every Linear of `model` by `make(linear)`, in place, one at a time, so each original
    is dropped as soon as its replacement exists (its weight freed unless `make` keeps it).
    Returns how many were replaced."""
    names = [name for name, module in model.named_modules() if isinstance(module, Linear)]
    for name in names:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, make(getattr(parent, attr)))
    return len(names)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype, device) -> None:
        super().__init__()
        self.weight = empty_param(dim, dtype=dtype, device=device)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype == torch.float32:  # the fused kernel is bitwise equal to HF's formula in fp32 only
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to max_positions, from the model's rope parameters
    (default, linear, dynamic, yarn, llama3, ... via transformers' own init functions)."""

    def __init__(self, hf_config, head_dim: int, max_positions: int, dtype, device) -> None:
        super().__init__()
        inv_freq, scaling = rope_inverse_frequencies(hf_config, head_dim)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :].float()
        cos, sin = freqs.cos() * scaling, freqs.sin() * scaling
        self.register_buffer("cos", torch.cat((cos, cos), dim=-1).to(dtype=dtype, device=device), persistent=False)
        # sin with its first half negated: rotate_half(x) * sin == x.roll(half) * signed_sin, exactly
        self.register_buffer(
            "signed_sin", torch.cat((-sin, sin), dim=-1).to(dtype=dtype, device=device), persistent=False
        )

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed_sin [T, 1, D] for `positions` [T]; looked up once per step, used by every layer."""
        return self.cos[positions].unsqueeze(1), self.signed_sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] rotated as HF's rotate-half convention does (x * cos + rotate_half(x) * sin),
    bit for bit: rotate_half(x) = (-x2, x1) = (x2, x1) * (-1, 1), and negation is exact."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


def rope_inverse_frequencies(hf_config, head_dim: int) -> tuple[torch.Tensor, float]:
    params = getattr(hf_config, "rope_parameters", None)
    if not params:  # transformers 4.x keeps theta and scaling apart
        params = {**(getattr(hf_config, "rope_scaling", None) or {}), "rope_theta": hf_config.rope_theta}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        base = params["rope_theta"]
        return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unsupported rope type {rope_type!r}")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, None)
    return inv_freq, float(scaling)
