"""The fused CPU layers (cpu_layers): swapped in at load for float32 (and bfloat16) on a CPU, and a model's
outputs with them equal those of the torch layers within float32 rounding, in prefills and batched
decodes. (Rows split across threads: tests/kernels/test_fused_kernels.py, and the default model's
greedy tests, whose prefill chunks are large enough.)"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.kernels import cpu as cpu_kernels
from pagoda.model_executor import cpu_layers
from pagoda.model_executor.layers import ResidualRMSNorm, RotaryEmbedding, SiluAndMul
from tests.tiny_models import write_tiny_model

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="the C kernels cannot be built on this machine")


def test_the_default_model_is_converted(default_llm):
    model = default_llm.engine.core.runner.model
    kinds = Counter(type(m) for m in model.modules())
    layers = model.dims.num_layers
    assert kinds[cpu_layers.CpuResidualRMSNorm] == 2 * layers + 1  # + the final norm
    assert kinds[cpu_layers.CpuSiluAndMul] == layers and kinds[cpu_layers.CpuRotaryEmbedding] == 1
    assert kinds[ResidualRMSNorm] == kinds[SiluAndMul] == kinds[RotaryEmbedding] == 0
    assert "layers.0.input_layernorm.weight" in dict(model.named_parameters())  # names unchanged


def test_supported_for_float32_and_bfloat16_on_cpu():
    assert cpu_layers.supported(torch.float32, torch.device("cpu"))
    assert cpu_layers.supported(torch.bfloat16, torch.device("cpu"))
    assert not cpu_layers.supported(torch.float16, torch.device("cpu"))
    assert not cpu_layers.supported(torch.float32, torch.device("cuda"))


def run(model_dir, prompts: list[list[int]]):
    llm = LLM(str(model_dir), max_model_len=1024, max_num_batched_tokens=1024, kv_cache_memory=0.05)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    return llm.engine.core.runner.model, llm.generate(prompts, params)


def token_logprobs(out) -> list[float]:
    """The logprob of each prompt token after the first, then of each sampled token."""
    positions = out.prompt_logprobs[1:] + out.outputs[0].logprobs
    tokens = out.prompt_token_ids[1:] + out.outputs[0].token_ids
    return [position[token].logprob for position, token in zip(positions, tokens)]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # qwen3: q/k norms before the rotation
def test_fused_layers_give_the_torch_layers_outputs(arch, tmp_path, monkeypatch):
    from pagoda.model_files import load_tokenizer

    model_dir = write_tiny_model(arch, tmp_path / arch, load_tokenizer(None))
    # a prefill of 700 tokens, then 4 decodes per step
    prompts = [[(7 * i) % 5000 + 100 for i in range(700)], [11, 12, 13], list(range(300, 340)), [42] * 9]
    fused_model, fused = run(model_dir, prompts)
    monkeypatch.setattr(cpu_layers, "supported", lambda dtype, device: False)
    torch_model, plain = run(model_dir, prompts)

    assert type(fused_model.norm) is cpu_layers.CpuResidualRMSNorm and type(torch_model.norm) is ResidualRMSNorm
    for a, b in zip(fused, plain):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        got, want = token_logprobs(a), token_logprobs(b)
        assert len(got) == len(a.prompt_token_ids) - 1 + 6
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-4, rtol=1e-4)
