"""FP8 weight quantization numerics on CPU (float8_e4m3fn tensors cast and multiply on CPU), and
the configurations that refuse it."""

from __future__ import annotations

import pytest
import torch

from pagoda.errors import ConfigError
from pagoda.model_executor.layers import Linear
from pagoda.model_executor.quantization import (
    FP8_MAX,
    Fp8Linear,
    dequantize,
    fp8_linear_reference,
    fp8_unsupported_reason,
    quantize_linears,
    quantize_per_channel,
    quantize_per_token,
)

# e4m3 keeps 3 mantissa bits: rounding to nearest errs by at most 2^-4 of a normal value, and by
# at most half the subnormal spacing (2^-10 of the row's scale) near zero.
REL_ROUNDING = 2**-4
SUBNORMAL_HALF_STEP = 2**-10
# A product of per-token-quantized activations and per-channel-quantized weights, relative
# Frobenius error against fp32 over 64 Gaussian tokens: 2.8% to 4.4% over 40 seeds; a scale on
# the wrong axis gives ~80%.
MATMUL_REL_TOL = 0.06


def linear(in_features=256, out_features=128, bias=True, seed=0) -> Linear:
    torch.manual_seed(seed)
    layer = Linear(in_features, out_features, bias, torch.float32, torch.device("cpu"))
    layer.weight.data.normal_(0, 0.05)
    layer.weight.data[3] *= 40  # rows of very different ranges: per-channel scales matter
    if bias:
        layer.bias.data.normal_()
    return layer


def test_per_channel_round_trip_within_fp8_rounding():
    w = linear().weight.data
    q, scale = quantize_per_channel(w)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (w.shape[0],)
    assert torch.equal(q.float().abs().amax(dim=1), torch.full((w.shape[0],), FP8_MAX))  # each row uses the full range
    bound = REL_ROUNDING * w.abs() + SUBNORMAL_HALF_STEP * scale[:, None] + 1e-6 * w.abs()
    assert ((dequantize(q, scale) - w).abs() <= bound).all()


def test_per_token_round_trip_within_fp8_rounding():
    x = torch.randn(9, 64) * torch.logspace(-3, 3, 9)[:, None]
    q, scale = quantize_per_token(x)
    assert scale.shape == (9, 1)
    bound = REL_ROUNDING * x.abs() + SUBNORMAL_HALF_STEP * scale + 1e-6 * x.abs()
    assert ((dequantize(q, scale) - x).abs() <= bound).all()


def test_zero_rows_stay_zero():
    q, scale = quantize_per_token(torch.zeros(2, 32))
    assert torch.isfinite(scale).all() and (q.float() == 0).all()


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("bias", [False, True])
def test_fp8_linear_reference_is_close_to_fp32(bias):
    layer = linear(bias=bias)
    x = torch.randn(64, 256)
    expected = torch.nn.functional.linear(x, layer.weight, layer.bias)
    assert relative_error(fp8_linear_reference(x, Fp8Linear(layer)), expected) < MATMUL_REL_TOL


def test_scaled_mm_computes_the_reference():
    """Fp8Linear's torch._scaled_mm (CPU here, cuBLASLt on a GPU) equals the dequantized product."""
    layer = Fp8Linear(linear())
    x = torch.randn(5, 256)
    assert relative_error(layer(x), fp8_linear_reference(x, layer)) < 1e-5


def test_quantized_tiny_model_keeps_its_logits(tiny_llama, monkeypatch):
    from pagoda.engine.args import EngineArgs
    from pagoda.model_executor.model_runner import ModelRunner

    # bfloat16, as on a GPU, below AVX512-BF16 (the ISA capped): float32 on CPU, and bfloat16 where
    # the CPU has AVX512-BF16, would have packed the linears for oneDNN already
    monkeypatch.setenv("PAGODA_CPU_ISA", "avx2")
    config = EngineArgs(str(tiny_llama), max_model_len=64, dtype="bfloat16").create_config()
    runner = ModelRunner(config)
    hidden = torch.randn(4, 64, dtype=torch.bfloat16)
    before = runner.model.compute_logits(hidden)
    x = torch.randn(6, 64, dtype=torch.bfloat16)
    mlp_before = runner.model.layers[0].mlp(x)
    assert quantize_linears(runner.model) == 2 * 2 * 2  # qkv, o, gate_up, down in 2 layers
    assert isinstance(runner.model.layers[1].self_attn.qkv_proj, Fp8Linear)
    assert runner.model.layers[0].mlp.gate_up_proj.weight.dtype == torch.float8_e4m3fn
    assert torch.equal(runner.model.compute_logits(hidden), before)  # the LM head stays unquantized
    assert relative_error(runner.model.layers[0].mlp(x), mlp_before) < 2 * MATMUL_REL_TOL


def test_a_mixtures_routers_stay_unquantized(tokenizer, tmp_path):
    """The router and the shared expert's gate keep the model's dtype (as vLLM's): fp8 would change
    which experts a token takes; every expert and the shared expert go to fp8."""
    from transformers import AutoConfig

    from pagoda.attention.torch_backend import TorchAttentionBackend
    from pagoda.model_executor.models.decoder import ARCHITECTURES, DecoderModel
    from tests.tiny_models import write_tiny_model

    path = write_tiny_model("qwen2_moe", tmp_path / "moe", tokenizer)
    hf_config = AutoConfig.from_pretrained(path)
    spec = ARCHITECTURES["Qwen2MoeForCausalLM"]
    model = DecoderModel(hf_config, spec, TorchAttentionBackend(), 64, torch.bfloat16, torch.device("cpu"))
    for p in model.parameters():
        p.data.normal_(0, 0.05)
    # layer 0 sparse (4 experts, a shared one), layer 1 dense: qkv and o twice, 4 x 2 experts' and
    # 2 shared ones, the dense MLP's 2
    assert quantize_linears(model) == 2 * 2 + 4 * 2 + 2 + 2
    moe = model.layers[0].mlp
    assert isinstance(moe.experts[3].down_proj, Fp8Linear) and isinstance(moe.shared_expert.gate_up_proj, Fp8Linear)
    assert type(moe.gate) is Linear and type(moe.shared_expert_gate) is Linear
    assert moe.gate.weight.dtype == torch.bfloat16


def test_dimensions_not_divisible_by_16_are_refused():
    with pytest.raises(ConfigError, match="divisible by 16"):
        Fp8Linear(Linear(72, 40, False, torch.float32, torch.device("cpu")))


@pytest.mark.parametrize(
    "capability,dtype,refused",
    [
        ((8, 0), torch.bfloat16, "compute capability >= 8.9"),
        ((8, 6), torch.bfloat16, "8.6"),
        ((8, 9), torch.bfloat16, None),
        ((9, 0), torch.bfloat16, None),
        ((9, 0), torch.float32, "bfloat16"),
    ],
)
def test_fp8_needs_ada_or_hopper_and_bfloat16(capability, dtype, refused):
    reason = fp8_unsupported_reason(capability, dtype)
    assert reason is None if refused is None else refused in reason


def test_fp8_on_cpu_is_a_config_error(tiny_llama):
    from pagoda.engine.args import EngineArgs

    with pytest.raises(ConfigError, match="quantization='fp8' needs a CUDA GPU"):
        EngineArgs(str(tiny_llama), quantization="fp8").create_config()
    with pytest.raises(ConfigError, match="Unknown quantization 'int4'"):
        EngineArgs(str(tiny_llama), quantization="int4").create_config()
