"""Linear layers and embeddings on quantized weights on the CPU, by Pagoda's C kernels (csrc/quant.c).

Formats: GGUF's Q4_0, Q4_1 and Q8_0 blocks as the file stores them (`--quantization gguf`), and I8,
int8 with one float32 scale per output channel, symmetric, made at load from a float checkpoint
(`--quantization int8`). Activations stay float32 on every path: the kernels dequantize weights in
registers and sum in float32, so a layer computes x @ dequantize(w).T up to float rounding.
Paths by shape: one activation row (a batch-1 decode step) takes the GEMV, which streams each weight
once; two or more rows take the blocked GEMM, which dequantizes 16 weight rows at a time into a
per-thread panel and multiplies every activation row by it. No dequantized copy of a matrix is kept.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
from torch import nn

FORMAT_IDS = {"Q4_0": 0, "Q4_1": 1, "Q8_0": 2, "I8": 3}  # as csrc/quant.c numbers them
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}  # per 32 columns
BLOCK = 32
_MIN_SCALE = 1e-12  # an all-zero row still gets a finite scale


@dataclass(frozen=True)
class QuantWeight:
    """A weight [rows, in_features] in one of FORMAT_IDS' formats: `data` uint8 [rows, bytes per row]
    (GGUF's block layout, or int8 codes for I8), `scales` float32 [rows] for I8, else None."""

    format: str
    data: torch.Tensor
    scales: torch.Tensor | None
    in_features: int

    def __post_init__(self) -> None:
        rows, row_bytes = self.data.shape
        expected = self.in_features if self.format == "I8" else self.in_features // BLOCK * BLOCK_BYTES[self.format]
        if self.data.dtype != torch.uint8 or not self.data.is_contiguous() or row_bytes != expected:
            raise ValueError(f"{self.format} weight of {self.in_features} columns: bad data {self.data.shape}")
        if self.format != "I8" and self.in_features % BLOCK:
            raise ValueError(f"{self.format} needs columns in blocks of {BLOCK}, got {self.in_features}")

    @property
    def out_features(self) -> int:
        return self.data.shape[0]

    @property
    def nbytes(self) -> int:
        return self.data.numel() + (0 if self.scales is None else self.scales.numel() * 4)


def quantize_int8(weight: torch.Tensor) -> QuantWeight:
    """weight [out, in] -> I8: q = round(w / s) in [-127, 127], s = max |w[row]| / 127 per row.
    In chunks of rows, so the float temporaries stay small beside a large matrix (an LM head)."""
    rows, columns = weight.shape
    codes = torch.empty(rows, columns, dtype=torch.int8)
    scales = torch.empty(rows)
    step = max(1, 2**20 // max(columns, 1))
    for start in range(0, rows, step):
        w = weight[start : start + step].detach().float()
        s = (w.abs().amax(dim=1) / 127).clamp(min=_MIN_SCALE)
        codes[start : start + step] = torch.round(w / s[:, None]).clamp(-127, 127)
        scales[start : start + step] = s
    return QuantWeight("I8", codes.view(torch.uint8), scales, columns)


def _call(lib: ctypes.CDLL, name: str, weight: QuantWeight, *args) -> None:
    scales = None if weight.scales is None else weight.scales.data_ptr()
    getattr(lib, name)(FORMAT_IDS[weight.format], weight.data.data_ptr(), scales, *args, torch.get_num_threads())


def quant_matmul(lib: ctypes.CDLL, x: torch.Tensor, weight: QuantWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """x [m, in] (float32) @ dequantize(weight).T + bias -> float32 [m, out]: the GEMV for m == 1,
    the blocked GEMM otherwise."""
    x = x.float().contiguous()
    rows = x.shape[0]
    out = torch.empty(rows, weight.out_features)
    if rows == 0:
        return out
    bias_ptr = None if bias is None else bias.data_ptr()
    if rows == 1:
        _call(lib, "pagoda_q_gemv", weight, x.data_ptr(), out.data_ptr(), bias_ptr, weight.out_features, x.shape[1])
    else:
        _call(
            lib,
            "pagoda_q_gemm",
            weight,
            x.data_ptr(),
            out.data_ptr(),
            bias_ptr,
            rows,
            weight.out_features,
            x.shape[1],
        )
    return out


def dequantize_rows(lib: ctypes.CDLL, weight: QuantWeight, ids: torch.Tensor) -> torch.Tensor:
    """dequantize(weight)[ids] -> float32 [len(ids), in]."""
    ids = ids.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty(ids.numel(), weight.in_features)
    _call(lib, "pagoda_q_dequant_rows", weight, ids.data_ptr(), ids.numel(), weight.in_features, out.data_ptr())
    return out


class QuantLinear(nn.Module):
    """y = x @ dequantize(weight).T + bias, float32 in and out."""

    def __init__(self, weight: QuantWeight, bias: torch.Tensor | None, lib: ctypes.CDLL) -> None:
        super().__init__()
        self.weight, self.lib = weight, lib
        self.bias = None if bias is None else bias.detach().float().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        out = quant_matmul(self.lib, x.reshape(-1, shape[-1]), self.weight, self.bias)
        return out.reshape(*shape[:-1], -1)


class QuantEmbedding(nn.Module):
    """An embedding lookup that dequantizes only the rows looked up."""

    def __init__(self, weight: QuantWeight, lib: ctypes.CDLL) -> None:
        super().__init__()
        self.weight, self.lib = weight, lib

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return dequantize_rows(self.lib, self.weight, ids).reshape(*ids.shape, -1)
