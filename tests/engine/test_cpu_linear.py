"""Linear layers on the CPU: oneDNN's packed GEMMs and the single-row GEMV give F.linear's results
within float32 rounding, and in bfloat16 (where the CPU has AVX512-BF16; on AMX tiles where it has
those too) float32 math on the same bf16 values within bf16 rounding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagoda.kernels import cpu as cpu_kernels
from pagoda.model_executor import cpu_invariant, cpu_linear
from pagoda.model_executor.layers import Linear

pytestmark = pytest.mark.skipif(not cpu_linear.supported(torch.float32, torch.device("cpu")), reason="no oneDNN")
LIBS = [None] + ([cpu_kernels.load()] if cpu_kernels.load() is not None else [])
needs_native_bf16 = pytest.mark.skipif(
    not cpu_linear.supported(torch.bfloat16, torch.device("cpu")), reason="this CPU has no AVX512-BF16"
)


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


@needs_native_bf16
@pytest.mark.parametrize("rows", [1, 3, 32, 257])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("lib", LIBS, ids=lambda lib: "gemv" if lib else "onednn-only")
def test_bfloat16_matches_float32_math(rows, bias, lib):
    gen = torch.Generator().manual_seed(rows)
    weight, x = torch.randn(160, 96, generator=gen).bfloat16(), torch.randn(rows, 96, generator=gen).bfloat16()
    b = torch.randn(160, generator=gen).bfloat16() if bias else None
    out = cpu_linear.CpuLinear(weight, b, lib)(x)
    assert out.dtype == torch.bfloat16
    exact = F.linear(x.float(), weight.float(), None if b is None else b.float())
    torch.testing.assert_close(out.float(), exact, atol=1e-2, rtol=2**-7)


def test_supported_for_float32_on_cpu_and_bfloat16_where_native(monkeypatch):
    cpu = torch.device("cpu")
    assert cpu_linear.supported(torch.float32, cpu)
    assert not cpu_linear.supported(torch.float16, cpu)
    assert not cpu_linear.supported(torch.float32, torch.device("cuda"))
    assert cpu_linear.supported(torch.bfloat16, cpu) == ("avx512_bf16" in cpu_kernels.cpu_isa())
    monkeypatch.setenv("PAGODA_CPU_ISA", "avx512")  # the cap: bf16 keeps torch's path
    assert not cpu_linear.supported(torch.bfloat16, cpu)


def test_the_default_model_is_converted(default_llm):
    """Every projection and the tied LM head are CpuLinear (InvariantLinear in deterministic
    serving); the embeddings stay plain for lookups."""
    model = default_llm.engine.core.runner.model
    kind = cpu_invariant.InvariantLinear if default_llm.engine.config.deterministic else cpu_linear.CpuLinear
    assert not any(isinstance(m, Linear) for m in model.modules())
    assert sum(isinstance(m, kind) for m in model.modules()) == 4 * model.dims.num_layers + 1  # + LM head
    for rows in (1, 2):
        hidden = torch.randn(rows, model.dims.hidden)
        torch.testing.assert_close(
            model.compute_logits(hidden), F.linear(hidden, model.embed_tokens), atol=1e-4, rtol=1e-5
        )
