"""The quantized-weight kernels (csrc/quant.c) against a plain dequantize-then-matmul reference on
random tensors, built for this CPU and capped at AVX2. The GGUF formats' reference is the `gguf`
package's own dequantizer, so the block layout is checked too, not only self-consistency."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from pagoda.kernels import cpu as cpu_kernels
from pagoda.model_executor.quant_linear import QuantWeight, dequantize_rows, quant_matmul, quantize_int8

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="the C kernels cannot be built on this machine")

# (activation rows, weight rows, columns): one row (GEMV) and many (GEMM: 4-row tiles and a tail);
# weight rows below, at and across the 16-row panel and the 4-row tile; columns of one block, of
# blocks not filling a vector pair, and the default model's
SHAPES = [(1, 1, 32), (1, 7, 64), (1, 33, 96), (1, 1000, 576), (2, 5, 32), (3, 17, 96), (4, 16, 64), (9, 100, 576)]
# int8 takes any column count: with and without a vector tail
I8_SHAPES = SHAPES + [(1, 9, 40), (5, 19, 13), (1, 3, 7), (6, 33, 100)]


@pytest.fixture(params=["native", "avx2"], scope="module")
def lib(request) -> ctypes.CDLL:
    patch = pytest.MonkeyPatch()
    if request.param == "avx2":
        patch.setenv("PAGODA_CPU_ISA", "avx2")
    cpu_kernels.load.cache_clear()
    lib = cpu_kernels.load()
    assert lib is not None and (request.param == "native" or lib.isa[-1] == "avx2")
    yield lib
    patch.undo()
    cpu_kernels.load.cache_clear()


def quantized(fmt: str, rows: int, columns: int, seed: int) -> tuple[QuantWeight, torch.Tensor]:
    """A random weight in `fmt` and its float32 values by the reference dequantizer."""
    weight = torch.randn(rows, columns, generator=torch.Generator().manual_seed(seed))
    if fmt == "I8":
        q = quantize_int8(weight)
        return q, q.data.view(torch.int8).float() * q.scales[:, None]
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    qtype = GGMLQuantizationType[fmt]
    data = quantize(weight.numpy(), qtype)
    reference = torch.from_numpy(np.ascontiguousarray(dequantize(data, qtype), dtype=np.float32))
    return QuantWeight(fmt, torch.from_numpy(np.ascontiguousarray(data)), None, columns), reference


@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1", "Q8_0", "I8"])
def test_matmul_matches_dequantize_then_matmul(lib, fmt):
    for m, n, k in I8_SHAPES if fmt == "I8" else SHAPES:
        weight, reference = quantized(fmt, n, k, seed=m * n * k)
        gen = torch.Generator().manual_seed(m + n)
        x, bias = torch.randn(m, k, generator=gen), torch.randn(n, generator=gen)
        for b in (None, bias):
            expected = x.double() @ reference.double().T + (0 if b is None else b.double())
            out = quant_matmul(lib, x, weight, b)
            assert out.shape == (m, n)
            torch.testing.assert_close(out.double(), expected, atol=1e-4 * k**0.5, rtol=1e-5, msg=f"{m}x{n}x{k}")


@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1", "Q8_0", "I8"])
def test_dequantized_rows_are_exact(lib, fmt):
    weight, reference = quantized(fmt, 50, 96, seed=7)
    ids = torch.tensor([[0, 49], [3, 3]])
    torch.testing.assert_close(dequantize_rows(lib, weight, ids), reference[ids.reshape(-1)], atol=0, rtol=0)


def test_int8_quantization_is_symmetric_per_channel():
    weight = torch.tensor([[1.0, -0.5, 0.25], [0.0, 0.0, 0.0], [-3.0, 1.5, 0.0]])
    q = quantize_int8(weight)
    assert q.data.view(torch.int8).tolist() == [[127, -64, 32], [0, 0, 0], [-127, 64, 0]]
    torch.testing.assert_close(q.scales[[0, 2]], torch.tensor([1.0 / 127, 3.0 / 127]))
    assert q.scales[1] > 0  # a zero row still has a finite scale


def test_block_formats_refuse_partial_blocks():
    with pytest.raises(ValueError, match="blocks of 32"):
        QuantWeight("Q8_0", torch.zeros(2, 34, dtype=torch.uint8), None, 48)
