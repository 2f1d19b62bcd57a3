"""load_format="dummy": a directory with only config.json and tokenizer files gives a model of
the config's shapes with random weights, and the engine generates with it."""

from __future__ import annotations

import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.errors import ConfigError

from .conftest import write_config_dir


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_dummy_model_has_the_configs_shapes(arch, tokenizer, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    from pagoda.engine.args import EngineArgs
    from pagoda.model_executor.model_runner import ModelRunner

    hf_config = write_config_dir(arch, tmp_path / arch, tokenizer)
    assert not list((tmp_path / arch).glob("*.safetensors"))
    # bfloat16 below AVX512-BF16 (the ISA capped): on CPU, float32, and bfloat16 where the CPU has
    # AVX512-BF16, pack the linear weights for oneDNN, leaving no plain shapes to read
    monkeypatch.setenv("PAGODA_CPU_ISA", "avx2")
    args = EngineArgs(str(tmp_path / arch), load_format="dummy", max_model_len=64, dtype="bfloat16")
    runner = ModelRunner(args.create_config())
    with torch.device("meta"):
        reference = AutoModelForCausalLM.from_config(hf_config)
    ours = dict(runner.model.named_parameters())
    assert sum(p.numel() for p in ours.values()) == reference.num_parameters()
    layer = reference.model.layers[0]
    attn = layer.self_attn
    fused = sum(p.weight.shape[0] for p in (attn.q_proj, attn.k_proj, attn.v_proj))
    assert ours["layers.0.self_attn.qkv_proj.weight"].shape == (fused, attn.q_proj.weight.shape[1])
    assert ours["layers.0.mlp.down_proj.weight"].shape == layer.mlp.down_proj.weight.shape
    for name, param in ours.items():
        assert torch.isfinite(param).all(), name
        if name.endswith("norm.weight"):
            assert (param == 1).all(), name
        else:
            assert 0.2 < float(param.float().std()) < 0.8, name  # N(0, initializer_range=0.5)


def test_engine_generates_with_dummy_weights(tokenizer, tmp_path):
    write_config_dir("llama", tmp_path / "llama", tokenizer)
    llm = LLM(str(tmp_path / "llama"), load_format="dummy", kv_cache_memory=0.01, max_model_len=128)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outputs = llm.generate([list(range(5, 40)), [7, 8, 9]], params)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [12, 12]
    again = LLM(str(tmp_path / "llama"), load_format="dummy", kv_cache_memory=0.01, max_model_len=128)
    assert again.generate([[7, 8, 9]], params)[0].outputs[0].token_ids == outputs[1].outputs[0].token_ids  # seeded


def test_weights_are_needed_unless_dummy(tokenizer, tmp_path):
    write_config_dir("llama", tmp_path / "llama", tokenizer)
    with pytest.raises(ConfigError, match="No \\*.safetensors weights"):
        LLM(str(tmp_path / "llama"), kv_cache_memory=0.01, max_model_len=128)
    with pytest.raises(ConfigError, match="Unknown load_format 'pt'"):
        LLM(str(tmp_path / "llama"), load_format="pt")
