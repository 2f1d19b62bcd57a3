"""Linear layers and embeddings on quantized weights on the CPU, by Pagoda's C kernels.

GGUF's Q4_0, Q4_1 and Q8_0 (`--quantization gguf`, csrc/qdot.c): the file's blocks, rearranged
once at load into panels of 16 rows (same bytes, no dequantized copy). Activations are quantized
to int8 per 32-value block inside the kernel, as llama.cpp does, and each block's dot product is
an exact integer sum (AVX512-VNNI where the CPU has it, AVX2 elsewhere) scaled and summed in
float32 in a fixed order: one arithmetic for every batch size and instruction set, so a row's
output does not depend on its batch. Batch 1 (the GEMV) is the same code as the GEMM.
I8 (`--quantization int8`, csrc/quant.c): int8 with one float32 scale per output channel,
symmetric, made at load from a float checkpoint. Activations stay float32: the kernels dequantize
weights in registers (GEMV for one row, a blocked GEMM over 16-row float panels for more).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
from torch import nn

FORMAT_IDS = {"Q4_0": 0, "Q4_1": 1, "Q8_0": 2}  # as csrc/qdot.c numbers them
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}  # per 32 columns, as GGUF stores them
BLOCK = 32
PANEL_ROWS = 16  # rows per packed panel (csrc/qdot.c)
_MIN_SCALE = 1e-12  # an all-zero row still gets a finite scale


@dataclass(frozen=True)
class QuantWeight:
    """A weight [out_features, in_features] in I8 or one of FORMAT_IDS' formats: `data` uint8, for I8
    [rows, in_features] int8 codes with `scales` float32 [rows]; for the GGUF formats csrc/qdot.c's
    packed panels [ceil(rows / 16), bytes per panel] (made by `pack_gguf`) and `scales` None."""

    format: str
    data: torch.Tensor
    scales: torch.Tensor | None
    in_features: int
    out_features: int

    def __post_init__(self) -> None:
        if self.format != "I8" and self.in_features % BLOCK:
            raise ValueError(f"{self.format} needs columns in blocks of {BLOCK}, got {self.in_features}")
        if self.format == "I8":
            expected = (self.out_features, self.in_features)
        else:
            expected = (-(-self.out_features // PANEL_ROWS), _panel_bytes(self.format, self.in_features))
        if self.data.dtype != torch.uint8 or not self.data.is_contiguous() or tuple(self.data.shape) != expected:
            raise ValueError(f"{self.format} weight of {self.in_features} columns: bad data {self.data.shape}")

    @property
    def nbytes(self) -> int:
        return self.data.numel() + (0 if self.scales is None else self.scales.numel() * 4)


def _panel_bytes(fmt: str, columns: int) -> int:
    """Bytes of 16 rows in qdot.c's packed layout: GGUF's blocks' bytes, rearranged."""
    return PANEL_ROWS * columns // BLOCK * BLOCK_BYTES[fmt]


def pack_gguf(lib: ctypes.CDLL, fmt: str, rows: torch.Tensor, in_features: int) -> QuantWeight:
    """GGUF rows (uint8 [out, in / 32 * block bytes], as the file stores them) -> packed QuantWeight."""
    if in_features % BLOCK or rows.shape[1] != in_features // BLOCK * BLOCK_BYTES[fmt]:
        raise ValueError(f"{fmt} weight of {in_features} columns: bad rows {tuple(rows.shape)}")
    rows = rows.contiguous()
    n = rows.shape[0]
    packed = torch.empty(-(-n // PANEL_ROWS), _panel_bytes(fmt, in_features), dtype=torch.uint8)
    lib.pagoda_qd_pack(FORMAT_IDS[fmt], rows.data_ptr(), packed.data_ptr(), n, in_features, torch.get_num_threads())
    return QuantWeight(fmt, packed, None, in_features, n)


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
    return QuantWeight("I8", codes.view(torch.uint8), scales, columns, rows)


def quant_matmul(lib: ctypes.CDLL, x: torch.Tensor, weight: QuantWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """x [m, in] (float32) @ weight.T + bias -> float32 [m, out]. GGUF formats: int8 activations,
    one kernel for every m; I8: float activations, the GEMV for m == 1, the blocked GEMM otherwise."""
    x = x.float().contiguous()
    rows = x.shape[0]
    out = torch.empty(rows, weight.out_features)
    if rows == 0:
        return out
    bias_ptr, threads = None if bias is None else bias.data_ptr(), torch.get_num_threads()
    if weight.format != "I8":
        lib.pagoda_qd_matmul(
            FORMAT_IDS[weight.format],
            weight.data.data_ptr(),
            x.data_ptr(),
            out.data_ptr(),
            bias_ptr,
            rows,
            weight.out_features,
            x.shape[1],
            threads,
        )
    else:
        shape = (rows,) if rows > 1 else ()  # the GEMM takes the row count, the GEMV does not
        kernel = lib.pagoda_i8_gemm if rows > 1 else lib.pagoda_i8_gemv
        w, scales = weight.data.data_ptr(), weight.scales.data_ptr()
        kernel(w, scales, x.data_ptr(), out.data_ptr(), bias_ptr, *shape, weight.out_features, x.shape[1], threads)
    return out


def dequantize_rows(lib: ctypes.CDLL, weight: QuantWeight, ids: torch.Tensor) -> torch.Tensor:
    """dequantize(weight)[ids] -> float32 [len(ids), in]."""
    ids = ids.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty(ids.numel(), weight.in_features)
    args = (ids.data_ptr(), ids.numel(), weight.in_features, out.data_ptr(), torch.get_num_threads())
    if weight.format == "I8":
        lib.pagoda_i8_dequant_rows(weight.data.data_ptr(), weight.scales.data_ptr(), *args)
    else:
        lib.pagoda_qd_dequant_rows(FORMAT_IDS[weight.format], weight.data.data_ptr(), *args)
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
