"""Linear layers on the CPU: oneDNN's packed GEMMs and the single-row GEMV give F.linear's results
within float32 rounding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagoda.kernels import cpu as cpu_kernels
from pagoda.model_executor import cpu_linear
from pagoda.model_executor.layers import Linear

pytestmark = pytest.mark.skipif(not cpu_linear.supported(torch.float32, torch.device("cpu")), reason="no oneDNN")
LIBS = [None] + ([cpu_kernels.load()] if cpu_kernels.load() is not None else [])


@pytest.mark.parametrize("rows", [1, 3, 32, 257])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("lib", LIBS, ids=lambda lib: "gemv" if lib else "onednn-only")
def test_cpu_linear_matches_f_linear(rows, bias, lib):
    gen = torch.Generator().manual_seed(rows)
    weight, x = torch.randn(160, 96, generator=gen), torch.randn(rows, 96, generator=gen)
    b = torch.randn(160, generator=gen) if bias else None
    torch.testing.assert_close(cpu_linear.CpuLinear(weight, b, lib)(x), F.linear(x, weight, b), atol=1e-4, rtol=1e-5)


def test_strided_input():
    weight = torch.randn(32, 64)
    for rows in (1, 5):
        x = torch.randn(rows, 128)[:, ::2]
        assert not x.is_contiguous()
        torch.testing.assert_close(
            cpu_linear.CpuLinear(weight, None, LIBS[-1])(x), F.linear(x, weight), atol=1e-4, rtol=1e-5
        )


def test_plain_weight_kept_only_for_the_gemv():
    weight = torch.randn(32, 64)
    assert cpu_linear.CpuLinear(weight, None, None).weight is None
    if cpu_kernels.load() is not None:
        assert cpu_linear.CpuLinear(weight, None, cpu_kernels.load()).weight is not None
        assert cpu_linear.CpuLinear(torch.randn(32, 20), None, cpu_kernels.load()).lib is None  # 20 % 8: no GEMV


def test_supported_only_for_float32_on_cpu():
    assert cpu_linear.supported(torch.float32, torch.device("cpu"))
    assert not cpu_linear.supported(torch.bfloat16, torch.device("cpu"))
    assert not cpu_linear.supported(torch.float32, torch.device("cuda"))


def test_the_default_model_is_converted(default_llm):
    """Every projection and the tied LM head are CpuLinear; the embeddings stay plain for lookups."""
    model = default_llm.engine.core.runner.model
    assert not any(isinstance(m, Linear) for m in model.modules())
    assert (
        sum(isinstance(m, cpu_linear.CpuLinear) for m in model.modules()) == 4 * model.dims.num_layers + 1
    )  # + LM head
    for rows in (1, 2):
        hidden = torch.randn(rows, model.dims.hidden)
        torch.testing.assert_close(
            model.compute_logits(hidden), F.linear(hidden, model.embed_tokens), atol=1e-4, rtol=1e-5
        )
