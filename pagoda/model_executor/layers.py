"""Building blocks of decoder-only transformers, computed exactly as Hugging Face computes them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

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


def replace_modules(
    model: nn.Module, kind: type[nn.Module], make: Callable[[Any], nn.Module], keep: tuple[str, ...] = ()
) -> int:
    """Replace every submodule of `model` that is a `kind` by `make(module)`, in place, one at a
    time, so each original is dropped as soon as its replacement exists (its weights freed unless
    `make` keeps them), but those whose name ends with one of `keep`. Returns how many were replaced."""
    names = [name for name, module in model.named_modules() if isinstance(module, kind) and not name.endswith(keep)]
    for name in names:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, make(getattr(parent, attr)))
    return len(names)


def replace_linears(model: nn.Module, make: Callable[[Any], nn.Module], keep: tuple[str, ...] = ()) -> int:
    return replace_modules(model, Linear, make, keep)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    if dtype == torch.float32:  # torch's fused kernel is bitwise equal to HF's formula in fp32 only
        return F.rms_norm(x, weight.shape, weight, eps)
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype, device) -> None:
        super().__init__()
        self.weight = empty_param(dim, dtype=dtype, device=device)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class ResidualRMSNorm(nn.Module):
    """The norm in front of a sublayer, on the residual stream: adds the previous sublayer's output
    `x` to the stream and returns (the sum normalized, the sum). With no stream yet (the first
    layer), `x` starts it."""

    def __init__(self, dim: int, eps: float, dtype, device) -> None:
        super().__init__()
        self.weight = empty_param(dim, dtype=dtype, device=device)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        residual = x if residual is None else residual + x
        return rms_norm(residual, self.weight, self.eps), residual


class SiluAndMul(nn.Module):
    """silu(gate) * up from a fused projection's output [T, 2I] = [gate | up] -> [T, I]."""

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


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

    def lookup(self, positions: torch.Tensor) -> Rotation:
        """The rotation of the tokens at `positions` [T]: looked up once per step, used by every layer."""
        return TableRotation(self.cos[positions].unsqueeze(1), self.signed_sin[positions].unsqueeze(1))


class Rotation(Protocol):
    """Rotates the query or key heads x [T, heads, D] of one step's tokens, each by its position's
    angles. May rotate x in place: callers use only the returned tensor."""

    def apply(self, x: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class TableRotation:
    """The step's angles gathered from the tables; rotates out of place, in torch."""

    cos: torch.Tensor  # [T, 1, D]
    signed_sin: torch.Tensor  # [T, 1, D]

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return apply_rotary(x, self.cos, self.signed_sin)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] rotated as HF's rotate-half convention does (x * cos + rotate_half(x) * sin),
    bit for bit: rotate_half(x) = (-x2, x1) = (x2, x1) * (-1, 1), and negation is exact."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


# rope types whose frequencies transformers recomputes as the sequence grows (longrope past its
# original length); one table computed at load cannot follow them, so the loader refuses them
SEQUENCE_LENGTH_ROPES = frozenset({"longrope"})


def _rope_parameters(hf_config) -> dict:
    params = getattr(hf_config, "rope_parameters", None)
    if not params:  # transformers 4.x keeps theta and scaling apart
        params = {**(getattr(hf_config, "rope_scaling", None) or {}), "rope_theta": hf_config.rope_theta}
    return params


def partial_rotary_factor(hf_config) -> float:
    """The share of each head the rotary embedding turns (1: all of it, the only one Pagoda computes)."""
    factor = _rope_parameters(hf_config).get("partial_rotary_factor")
    return float(factor if factor is not None else getattr(hf_config, "partial_rotary_factor", None) or 1.0)


def rope_type_of(hf_config) -> str:
    params = _rope_parameters(hf_config)
    return params.get("rope_type", params.get("type", "default"))


def rope_inverse_frequencies(hf_config, head_dim: int) -> tuple[torch.Tensor, float]:
    params = _rope_parameters(hf_config)
    rope_type = rope_type_of(hf_config)
    if rope_type == "default":
        base = params["rope_theta"]
        return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unsupported rope type {rope_type!r}")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, None)
    return inv_freq, float(scaling)
