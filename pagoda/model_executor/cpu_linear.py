"""Linear layers on the CPU in float32, and in bfloat16 where the CPU multiplies bf16 natively:
oneDNN GEMMs on pre-packed weights, and Pagoda's C GEMV for single rows.

Packing each weight once into oneDNN's blocked layout makes GEMMs faster than torch's default path
(MKL on the plain layout): measured on 2 AVX2 cores, 1.3x to 2.5x for 1 to 32 rows and 1.3x for
1,024. A single row (a decode step at batch 1) only streams the weight, and the C GEMV streams it
closer to memory bandwidth than either library (1.3-1.8x oneDNN by shape), so where the kernels
build, each layer keeps its plain weight for it too: linear weights are held twice.
bf16 takes this path on CPUs with AVX512-BF16 (or AMX, which comes with it), within the
PAGODA_CPU_ISA cap: there oneDNN's bf16 GEMMs run about 4x faster than its fp32 ones, and the bf16
GEMV streams half the bytes of the fp32 one. Where the CPU has AMX, Pagoda's own tile GEMM takes
oneDNN's place. Elsewhere bf16 is emulated, and it and fp16 keep
torch's path.
"""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from pagoda.kernels import cpu
from pagoda.model_executor.layers import replace_linears


def supported(dtype: torch.dtype, device: torch.device) -> bool:
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and "avx512_bf16" in cpu.cpu_isa())


def _on_tiles(lib: ctypes.CDLL | None, dtype: torch.dtype) -> bool:
    """bf16 where the kernels have AMX tiles: Pagoda's tile GEMM (csrc/bf16.c) packs the weights."""
    return lib is not None and lib.amx and dtype == torch.bfloat16


def packer(dtype: torch.dtype) -> str:
    """Whose layout CpuLinear packs `dtype` weights into here (a supported dtype)."""
    return "AMX tiles" if _on_tiles(cpu.load(), dtype) else "oneDNN"


class CpuLinear(nn.Module):
    """y = x @ weight.T + bias from a packed copy of `weight` (oneDNN's, or AMX tiles for bf16 where
    the kernels have them), or from the plain weight by the GEMV kernel for one row when `lib` is
    given (the plain weight is dropped otherwise).
    float32 or bfloat16 (weight, bias and x alike; the bf16 GEMV sums in fp32 with an fp32 bias)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, lib: ctypes.CDLL | None) -> None:
        super().__init__()
        weight = weight.detach()
        self.out_features, in_features = weight.shape
        # bf16 on AMX: Pagoda's tile GEMM (csrc/bf16.c): over the default model's linears 0.44-0.51x
        # oneDNN's time at 2-32 rows, 0.66-0.93x at 48-1,024 (2-core Intel AMX machine); oneDNN's
        # packed weight otherwise
        amx = _on_tiles(lib, weight.dtype) and in_features % 32 == 0
        self.tiles = cpu.pack_bf16_tiles(lib, weight) if amx else None
        self.packed = None if amx else torch.ops.mkldnn._reorder_linear_weight(weight)
        self.bias = bias
        self.lib = lib if in_features % 8 == 0 else None
        self.weight = weight if self.lib is not None else None  # a plain attribute, not a parameter
        self.gemv_bias = None if bias is None else bias.detach().float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.lib is not None and x.shape[0] == 1:
            if x.dtype == torch.bfloat16:
                return cpu.gemv_bf16(self.lib, x.contiguous(), self.weight, self.gemv_bias, x.dtype)
            return cpu.gemv(self.lib, x.contiguous(), self.weight, self.gemv_bias)
        if self.tiles is not None:
            return cpu.gemm_bf16(self.lib, x, self.tiles, self.gemv_bias, self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def convert_model(model) -> None:
    """Every Linear of a DecoderModel replaced by its CpuLinear, and a CpuLinear LM head for
    compute_logits (over the embeddings when they are tied; they stay plain for lookups)."""
    lib = cpu.load()
    replace_linears(model, lambda linear: CpuLinear(linear.weight, linear.bias, lib))
    if model.computes_logits:
        model.cpu_lm_head = CpuLinear(model.embed_tokens if model.lm_head is None else model.lm_head, None, lib)
