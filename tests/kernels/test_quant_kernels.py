"""The quantized-weight kernels (csrc/qdot.c, int8 activations) on random tensors, built for this CPU
and capped at AVX2. Every format (GGUF's from the file's blocks, I8 from its plain per-row codes
and scales) against the same arithmetic written plainly in torch (activations quantized per
32-block, integer block dots, float combination), and bitwise: a row's output is the same alone
(GEMV) as in a batch (GEMM), and on AVX2 as on this CPU's widest path. Embedding rows equal the
`gguf` package's own dequantizer, so the block layout is checked too, not only self-consistency."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagoda.kernels import cpu as cpu_kernels
from pagoda.model_executor.quant_linear import (
    FORMAT_IDS,
    QuantWeight,
    dequantize_rows,
    int8_codes,
    pack_gguf,
    quant_matmul,
    quantize_int8,
)

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="the C kernels cannot be built on this machine")

# (activation rows, weight rows, columns): one row (GEMV) and many (GEMM: 4-row tiles and a tail);
# weight rows below, at and across the 16-row panel and the 4-row tile; columns of one block, of
# blocks not filling a vector pair, and the default model's
SHAPES = [(1, 1, 32), (1, 7, 64), (1, 33, 96), (1, 1000, 576), (2, 5, 32), (3, 17, 96), (4, 16, 64), (9, 100, 576)]
# I8 takes any column count (the last block zero-padded): with and without a partial block
I8_SHAPES = SHAPES + [(1, 9, 40), (5, 19, 13), (1, 3, 7), (6, 33, 100)]


def gguf_rows(fmt: str, weight: torch.Tensor) -> tuple[np.ndarray, torch.Tensor]:
    """`weight` quantized by the `gguf` package: the file's rows and their float32 values."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    qtype = GGMLQuantizationType[fmt]
    data = np.ascontiguousarray(quantize(weight.numpy(), qtype))
    return data, torch.from_numpy(np.ascontiguousarray(dequantize(data, qtype), dtype=np.float32))


def quantized(lib, fmt: str, rows: int, columns: int, seed: int) -> tuple[QuantWeight, torch.Tensor]:
    """A random weight in GGUF's `fmt` and its float32 values by the reference dequantizer."""
    weight = torch.randn(rows, columns, generator=torch.Generator().manual_seed(seed))
    data, reference = gguf_rows(fmt, weight)
    return pack_gguf(lib, fmt, torch.from_numpy(data), columns), reference


def block_fields(fmt: str, data: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GGUF rows [n, blocks * bytes] -> per block d, m (0 where none) [n, nb] and codes [n, nb, 32]
    (Q4_0's still offset by 8), read plainly from the bytes."""
    n = data.shape[0]
    blocks = data.reshape(n, -1, {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[fmt])
    d = torch.from_numpy(blocks[:, :, 0:2].copy().view(np.float16)[..., 0].astype(np.float32))
    m = torch.zeros_like(d)
    if fmt == "Q8_0":
        return d, m, torch.from_numpy(blocks[:, :, 2:].copy().view(np.int8).astype(np.int64))
    if fmt == "Q4_1":
        m = torch.from_numpy(blocks[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float32))
    nibbles = torch.from_numpy(blocks[:, :, -16:].astype(np.int64))
    return d, m, torch.cat([nibbles & 15, nibbles >> 4], dim=2)


def quantized_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x's 32-blocks (the last zero-padded) as int8 codes a (int64 [m, blocks, 32]) with scales
    da = max|x| / 127 [m, blocks], a = round(x / da), ties to even as the kernel."""
    blocks = torch.nn.functional.pad(x, (0, -x.shape[1] % 32)).reshape(x.shape[0], -1, 32)
    da = blocks.abs().amax(dim=2) / 127
    inv = torch.where(da != 0, 1 / da, torch.zeros_like(da))
    return torch.round(blocks * inv[..., None]).long(), da


def reference_matmul(fmt: str, x: torch.Tensor, data: np.ndarray) -> torch.Tensor:
    """llama.cpp's arithmetic written plainly: x's 32-blocks quantized to int8 codes a with scale da,
    exact integer dots per block, summed as sum(dw * da * isum [+ mw * da * sum(a)])."""
    a, da = quantized_activations(x)
    dw, mw, q = block_fields(fmt, data)
    if fmt == "Q4_0":
        q = q - 8
    isum = torch.einsum("mbj,nbj->mnb", a, q)  # exact, int64
    terms = dw[None].double() * da[:, None].double() * isum.double()
    terms += mw[None].double() * (da * a.sum(dim=2)).double()[:, None]
    return terms.sum(dim=2)


def reference_int8_matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The same for I8: exact integer dots per block, s * sum(da * isum) with the row's scale s."""
    a, da = quantized_activations(x)
    q = torch.nn.functional.pad(codes.long(), (0, -codes.shape[1] % 32)).reshape(codes.shape[0], -1, 32)
    isum = torch.einsum("mbj,nbj->mnb", a, q)
    return (da[:, None].double() * isum.double()).sum(dim=2) * scales.double()


def format_case(fmt: str, weight: torch.Tensor):
    """(pack(lib) -> QuantWeight, reference(x) -> float64 x @ w.T by the int8-activation arithmetic)"""
    if fmt == "I8":
        codes, scales = int8_codes(weight)
        return lambda lib: quantize_int8(weight), lambda x: reference_int8_matmul(x, codes, scales)
    data, _ = gguf_rows(fmt, weight)
    k = weight.shape[1]
    return lambda lib: pack_gguf(lib, fmt, torch.from_numpy(data), k), lambda x: reference_matmul(fmt, x, data)


@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1", "Q8_0", "I8"])
def test_matmul_matches_int8_activation_reference(libs, fmt):
    for m, n, k in I8_SHAPES if fmt == "I8" else SHAPES:
        weight = torch.randn(n, k, generator=torch.Generator().manual_seed(m * n * k))
        if n > 2:
            weight[1] = 0  # an all-zero row: the smallest scale
        pack, reference = format_case(fmt, weight)
        gen = torch.Generator().manual_seed(m + n)
        x, bias = torch.randn(m, k, generator=gen), torch.randn(n, generator=gen)
        x[0, :32] = 0  # an all-zero block: scale 0
        expected = reference(x)
        outputs = []
        for lib in libs.values():
            packed = pack(lib)
            for b in (None, bias):
                out = quant_matmul(lib, x, packed, b)
                want = expected + (0 if b is None else b.double())
                torch.testing.assert_close(out.double(), want, atol=1e-4 * k**0.5, rtol=1e-5, msg=f"{m}x{n}x{k}")
            alone = torch.cat([quant_matmul(lib, x[i : i + 1], packed, bias) for i in range(m)])
            assert torch.equal(alone, out), f"GEMV rows differ from the GEMM's, {fmt} {m}x{n}x{k}"
            outputs.append(out)
        assert torch.equal(outputs[0], outputs[1]), f"AVX2 differs from the native path, {fmt} {m}x{n}x{k}"


# activation rows for the tiles: below, at and across the 8-row half tile (its own combine), the 16-row
# tile and several of them; (weight rows, columns): one panel, a partial last panel, partial blocks (I8)
TILE_ROWS = (1, 5, 8, 9, 16, 17, 24, 33, 64)
TILE_WEIGHTS = [(16, 32), (40, 96), (100, 576)]
NO_TILES = "no AMX tiles here (the CPU, the OS or a PAGODA_CPU_ISA cap)"


@pytest.mark.skipif(not getattr(cpu_kernels.load(), "amx", False), reason=NO_TILES)
@pytest.mark.parametrize("fmt", FORMAT_IDS)
def test_amx_tiles_equal_the_vector_path(libs, fmt):
    """The AMX path sums the same exact integers and combines them with the same float steps: its
    outputs equal the vector path's bitwise, for every row count (rows past the last whole tile
    run as zero codes) and with or without a bias."""
    lib = libs["native"]
    for n, k in TILE_WEIGHTS + ([(19, 13), (33, 100)] if fmt == "I8" else []):
        weight = torch.randn(n, k, generator=torch.Generator().manual_seed(n * k))
        packed = format_case(fmt, weight)[0](lib)
        gen = torch.Generator().manual_seed(n + k)
        bias = torch.randn(n, generator=gen)
        for m in TILE_ROWS:
            x = torch.randn(m, k, generator=gen)
            for b in (None, bias):
                vectors = quant_matmul(lib, x, packed, b, tiles=False)
                assert torch.equal(quant_matmul(lib, x, packed, b, tiles=True), vectors), f"{fmt} {m}x{n}x{k}"


def test_int8_matmul_is_close_to_float(lib):
    """I8 against the float matmul on the unquantized weight: the two roundings (per-row weights,
    per-block activations) stay a small relative error (about 0.009 on Gaussian data)."""
    weight = torch.randn(200, 576, generator=torch.Generator().manual_seed(1))
    x = torch.randn(5, 576, generator=torch.Generator().manual_seed(2))
    expected = x @ weight.T
    error = (quant_matmul(lib, x, quantize_int8(weight), None) - expected).norm() / expected.norm()
    assert error < 0.02, error


@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1", "Q8_0"])
def test_dequantized_rows_are_exact(lib, fmt):
    weight, reference = quantized(lib, fmt, 50, 96, seed=7)
    ids = torch.tensor([[0, 49], [3, 3]])
    torch.testing.assert_close(dequantize_rows(lib, weight, ids), reference[ids.reshape(-1)], atol=0, rtol=0)


def test_int8_quantization_is_symmetric_per_channel():
    weight = torch.tensor([[1.0, -0.5, 0.25], [0.0, 0.0, 0.0], [-3.0, 1.5, 0.0]])
    codes, scales = int8_codes(weight)
    assert codes.tolist() == [[127, -64, 32], [0, 0, 0], [-127, 64, 0]]
    torch.testing.assert_close(scales[[0, 2]], torch.tensor([1.0 / 127, 3.0 / 127]))
    assert scales[1] > 0  # a zero row still has a finite scale
    packed = quantize_int8(weight)  # one panel: 16 scales, one block of 32 one-byte codes per row
    assert packed.data.shape == (1, 16 * 4 + 16 * 32) and packed.nbytes == 576


def test_block_formats_refuse_partial_blocks(libs):
    with pytest.raises(ValueError, match="blocks of 32"):
        QuantWeight("Q8_0", torch.zeros(1, 34 * 16, dtype=torch.uint8), 48, 2)
    with pytest.raises(ValueError, match="bad rows"):
        pack_gguf(libs["native"], "Q8_0", torch.zeros(2, 34, dtype=torch.uint8), 48)
