"""Linear layers and embeddings on quantized weights on the CPU, by Pagoda's C kernels (csrc/qdot.c).

GGUF's Q4_0, Q4_1 and Q8_0 (`--quantization gguf`): the file's blocks, rearranged once at load
into panels of 16 rows (same bytes, no dequantized copy). I8 (`--quantization int8`): int8 codes
with one float32 scale per output channel, symmetric, made at load from a float checkpoint, in
panels of the same shape (Q8_0's code layout; the 16 rows' scales ahead of the blocks instead of
an fp16 scale per block). For every format activations are quantized to int8 per 32-value block
inside the kernel, as llama.cpp does, and each block's dot product is an exact integer sum
(AVX512-VNNI where the CPU has it, AVX2 elsewhere) scaled and summed in float32 in a fixed order:
one arithmetic for every batch size and instruction set, so a row's output does not depend on its
batch. Batch 1 (the GEMV) is the same code as the GEMM.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
from torch import nn

FORMAT_IDS = {"Q4_0": 0, "Q4_1": 1, "Q8_0": 2, "I8": 3}  # as csrc/qdot.c numbers them
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}  # per 32 columns, as GGUF stores them
BLOCK = 32
PANEL_ROWS = 16  # rows per packed panel (csrc/qdot.c)
# activation rows from which the AMX tiles beat the vector path: half a tile for byte codes, a whole
# one for Q4 (its nibbles are unpacked per call; measured on a 2-core Intel AMX machine)
AMX_MIN_ROWS = {"Q4_0": 16, "Q4_1": 16, "Q8_0": 8, "I8": 8}
GROUP = 4  # columns per code group of an I8 block: [16 rows][4 codes]
_MIN_SCALE = 1e-12  # an all-zero row still gets a finite scale


@dataclass(frozen=True)
class QuantWeight:
    """A weight [out_features, in_features] in one of FORMAT_IDS' formats: `data` uint8, csrc/qdot.c's
    packed panels [ceil(rows / 16), bytes per panel] (made by `pack_gguf` or `quantize_int8`)."""

    format: str
    data: torch.Tensor
    in_features: int
    out_features: int

    def __post_init__(self) -> None:
        if self.format != "I8" and self.in_features % BLOCK:
            raise ValueError(f"{self.format} needs columns in blocks of {BLOCK}, got {self.in_features}")
        expected = (-(-self.out_features // PANEL_ROWS), _panel_bytes(self.format, self.in_features))
        if self.data.dtype != torch.uint8 or not self.data.is_contiguous() or tuple(self.data.shape) != expected:
            raise ValueError(f"{self.format} weight of {self.in_features} columns: bad data {self.data.shape}")

    @property
    def nbytes(self) -> int:
        return self.data.numel()


def _panel_bytes(fmt: str, columns: int) -> int:
    """Bytes of 16 rows in qdot.c's packed layout: GGUF's blocks' bytes, rearranged; for I8 the rows'
    float32 scales, then one byte per code, columns zero-padded to whole blocks."""
    if fmt == "I8":
        return PANEL_ROWS * 4 + PANEL_ROWS * -(-columns // BLOCK) * BLOCK
    return PANEL_ROWS * columns // BLOCK * BLOCK_BYTES[fmt]


def pack_gguf(lib: ctypes.CDLL, fmt: str, rows: torch.Tensor, in_features: int) -> QuantWeight:
    """GGUF rows (uint8 [out, in / 32 * block bytes], as the file stores them) -> packed QuantWeight."""
    if in_features % BLOCK or rows.shape[1] != in_features // BLOCK * BLOCK_BYTES[fmt]:
        raise ValueError(f"{fmt} weight of {in_features} columns: bad rows {tuple(rows.shape)}")
    rows = rows.contiguous()
    n = rows.shape[0]
    packed = torch.empty(-(-n // PANEL_ROWS), _panel_bytes(fmt, in_features), dtype=torch.uint8)
    lib.pagoda_qd_pack(FORMAT_IDS[fmt], rows.data_ptr(), packed.data_ptr(), n, in_features, torch.get_num_threads())
    return QuantWeight(fmt, packed, in_features, n)


def int8_codes(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [rows, in] -> its I8 codes q = round(w / s) in [-127, 127] (int8 [rows, in]) and the
    per-row scales s = max |w[row]| / 127 (float32 [rows])."""
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1) / 127).clamp(min=_MIN_SCALE)
    return torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8), scales


def quantize_int8(weight: torch.Tensor) -> QuantWeight:
    """weight [out, in] -> I8 in qdot.c's panels: per panel of 16 rows their scales (float32), then per
    block of 32 columns 8 groups of [16 rows][4 codes]. In chunks of panels, so the temporaries stay
    small beside a large matrix (an LM head)."""
    rows, columns = weight.shape
    blocks = -(-columns // BLOCK)
    packed = torch.empty(-(-rows // PANEL_ROWS), _panel_bytes("I8", columns), dtype=torch.uint8)
    step = max(1, 2**20 // (PANEL_ROWS * max(columns, 1)))  # panels per chunk
    for first in range(0, packed.shape[0], step):
        panels = packed[first : first + step]
        start, count = first * PANEL_ROWS, min(rows - first * PANEL_ROWS, panels.shape[0] * PANEL_ROWS)
        codes, scales = int8_codes(weight[start : start + count])
        padded = torch.zeros(panels.shape[0] * PANEL_ROWS, blocks * BLOCK, dtype=torch.int8)
        padded[:count, :columns] = codes
        grouped = padded.view(-1, PANEL_ROWS, blocks, BLOCK // GROUP, GROUP).permute(0, 2, 3, 1, 4)
        panels[:, PANEL_ROWS * 4 :] = grouped.reshape(panels.shape[0], -1).view(torch.uint8)
        padded_scales = torch.zeros(panels.shape[0] * PANEL_ROWS)
        padded_scales[:count] = scales
        panels[:, : PANEL_ROWS * 4] = padded_scales.view(-1, PANEL_ROWS).view(torch.uint8)
    return QuantWeight("I8", packed, columns, rows)


def amx_tiles_from(lib: ctypes.CDLL, fmt: str) -> int:
    """qdot.c's tiles_from for a weight in `fmt`: the activation rows from which its integer dots run
    on AMX tiles (AMX_MIN_ROWS where the OS granted the tiles), 0 for never."""
    return AMX_MIN_ROWS[fmt] if lib.amx else 0


def quant_matmul(
    lib: ctypes.CDLL, x: torch.Tensor, weight: QuantWeight, bias: torch.Tensor | None, tiles: bool | None = None
) -> torch.Tensor:
    """x [m, in] (float32) @ weight.T + bias -> float32 [m, out]: int8 activations, one arithmetic
    for every format and every m; the integer dots on AMX tiles (`tiles`: always or
    never; by default from amx_tiles_from's rows), else in vector registers, bitwise the same."""
    x = x.float().contiguous()
    rows = x.shape[0]
    out = torch.empty(rows, weight.out_features)
    if rows == 0:
        return out
    lib.pagoda_qd_matmul(
        FORMAT_IDS[weight.format],
        weight.data.data_ptr(),
        x.data_ptr(),
        out.data_ptr(),
        None if bias is None else bias.data_ptr(),
        rows,
        weight.out_features,
        x.shape[1],
        amx_tiles_from(lib, weight.format) if tiles is None else int(tiles),
        torch.get_num_threads(),
    )
    return out


def dequantize_rows(lib: ctypes.CDLL, weight: QuantWeight, ids: torch.Tensor) -> torch.Tensor:
    """dequantize(weight)[ids] -> float32 [len(ids), in]; GGUF formats (an I8 model keeps its
    embedding table float)."""
    if weight.format not in BLOCK_BYTES:
        raise ValueError(f"no embedding lookup on {weight.format} weights")
    ids = ids.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty(ids.numel(), weight.in_features)
    lib.pagoda_qd_dequant_rows(
        FORMAT_IDS[weight.format],
        weight.data.data_ptr(),
        ids.data_ptr(),
        ids.numel(),
        weight.in_features,
        out.data_ptr(),
        torch.get_num_threads(),
    )
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
