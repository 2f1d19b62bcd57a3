"""CPU GEMMs on oneDNN's pre-packed weights.

Packing each linear weight once into oneDNN's blocked layout makes fp32 GEMMs on CPU faster than
torch's default path (MKL on the plain layout), most at the small row counts of decode steps:
measured on 2 AVX2 cores, 1.3x for one row, up to 2.5x for 8 to 32 rows, and 2x for the LM head.
oneDNN packs fp32 only on CPUs without AVX-512 (bf16 and fp16 need AVX-512 or AVX-NE-CONVERT), so
other dtypes keep the plain path.
"""

from __future__ import annotations

import torch
from torch import nn

from pagoda.model_executor.layers import Linear, replace_linears


def supported(dtype: torch.dtype, device: torch.device) -> bool:
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


def pack(weight: torch.Tensor) -> torch.Tensor:
    """An [out, in] weight in oneDNN's layout for `packed_linear` (a new tensor; the input stays)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach())


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class PackedLinear(nn.Module):
    """A Linear whose weight lives only in oneDNN's packed layout (made from a loaded Linear)."""

    def __init__(self, linear: Linear) -> None:
        super().__init__()
        self.out_features, self.in_features = linear.weight.shape
        self.packed = pack(linear.weight)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.packed, self.bias)


def pack_model(model) -> None:
    """Every Linear of a DecoderModel replaced by its PackedLinear (each plain weight freed as it
    goes), and a packed copy of the LM head for compute_logits (the embeddings stay plain)."""
    replace_linears(model, PackedLinear)
    model.packed_lm_head = pack(model.embed_tokens if model.lm_head is None else model.lm_head)
