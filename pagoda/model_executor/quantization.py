"""FP8 weight quantization: linear weights stored in float8_e4m3fn with one scale per output
channel, multiplied by torch._scaled_mm against activations quantized per token on the fly.

    w ~ w_fp8 * w_scale[out]      x ~ x_fp8 * x_scale[token]      y = (x_fp8 @ w_fp8.T) * x_scale * w_scale

Embeddings, the LM head and norms stay in the model dtype (bfloat16). FP8 matrix products need
compute capability 8.9 or newer (Ada, Hopper); elsewhere the configuration is refused.
"""

from __future__ import annotations

import torch
from torch import nn

from pagoda.errors import ConfigError
from pagoda.model_executor.layers import Linear, replace_linears

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
MIN_CAPABILITY = (8, 9)
MIN_SCALE = 1e-12  # an all-zero row or token still gets a finite scale


def check_fp8_support(device: torch.device, dtype: torch.dtype) -> None:
    """Raise ConfigError unless `quantization="fp8"` can run on `device` in `dtype`."""
    if device.type != "cuda":
        raise ConfigError(f"quantization='fp8' needs a CUDA GPU of compute capability >= 8.9; the device is {device}.")
    capability = torch.cuda.get_device_capability(device)
    reason = fp8_unsupported_reason(capability, dtype)
    if reason:
        raise ConfigError(reason)


def fp8_unsupported_reason(capability: tuple[int, int], dtype: torch.dtype) -> str | None:
    if capability < MIN_CAPABILITY:
        return (
            f"quantization='fp8' needs compute capability >= 8.9 (Ada or Hopper); this GPU has "
            f"{capability[0]}.{capability[1]}. Leave quantization unset."
        )
    if dtype != torch.bfloat16:
        dtype_name = str(dtype).removeprefix("torch.")
        return f"quantization='fp8' computes in bfloat16; dtype is {dtype_name}. Use dtype auto or bfloat16."
    return None


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] -> (float8 [out, in], float32 scale [out]) with weight ~ q * scale[:, None]."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) * (1 / FP8_MAX)).clamp(min=MIN_SCALE)  # as quantize_per_token's
    return (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, in] -> (float8 [T, in], float32 scale [T, 1]); no host synchronisation (graph-safe)."""
    x = x.float()
    # times the reciprocal, as torch divides by a number on a GPU: the same scale on every device,
    # and gpu_layers' one-kernel form's
    scale = (x.abs().amax(dim=1, keepdim=True) * (1 / FP8_MAX)).clamp(min=MIN_SCALE)
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 values of `q` under per-row `scale` ([rows] or [rows, 1])."""
    return q.float() * scale.reshape(-1, 1)


class Fp8Linear(nn.Module):
    """A Linear whose weight is float8 with per-output-channel scales (made from a loaded Linear)."""

    def __init__(self, linear: Linear) -> None:
        super().__init__()
        out_features, in_features = linear.weight.shape
        if in_features % 16 or out_features % 16:
            raise ConfigError(f"fp8 needs linear dimensions divisible by 16; got {out_features}x{in_features}.")
        q, scale = quantize_per_channel(linear.weight.data)
        self.weight = nn.Parameter(q, requires_grad=False)
        self.weight_scale = nn.Parameter(scale[None, :], requires_grad=False)  # [1, out], as _scaled_mm wants
        self.bias = linear.bias
        self.out_dtype = linear.weight.dtype
        self.quantize_activations = quantize_per_token  # gpu_layers.convert_model: its one-kernel form

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        xq, x_scale = self.quantize_activations(x.reshape(-1, shape[-1]))
        y = torch._scaled_mm(xq, self.weight.t(), scale_a=x_scale, scale_b=self.weight_scale, out_dtype=self.out_dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], -1)


def fp8_linear_reference(x: torch.Tensor, layer: Fp8Linear) -> torch.Tensor:
    """What Fp8Linear computes, in float32 from dequantized operands: the test oracle."""
    xq, x_scale = quantize_per_token(x.reshape(-1, x.shape[-1]))
    y = dequantize(xq, x_scale) @ dequantize(layer.weight, layer.weight_scale).t()
    if layer.bias is not None:
        y = y + layer.bias.float()
    return y.reshape(*x.shape[:-1], -1)


# a mixture's router and its shared expert's gate stay in the model's dtype, as vLLM keeps them: in
# fp8 they would change which experts a token takes
ROUTERS = (".mlp.gate", ".mlp.shared_expert_gate")


def quantize_linears(model: nn.Module) -> int:
    """Replace every Linear of `model` but the ROUTERS by its Fp8Linear, in place. Returns how many
    were replaced."""
    return replace_linears(model, Fp8Linear, keep=ROUTERS)
