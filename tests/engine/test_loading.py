"""Model loading: sharded safetensors, and models that cannot be served fail with a reason."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.config import ConfigError
from tests.reference import hf_greedy
from tests.tiny_models import write_tiny_model


@pytest.fixture(scope="module")
def tokenizer():
    from pagoda.model_files import load_tokenizer

    return load_tokenizer(None)


@pytest.fixture(scope="module")
def tiny_llama(tokenizer, tmp_path_factory):
    return write_tiny_model("llama", tmp_path_factory.mktemp("tiny") / "llama", tokenizer)


def test_sharded_safetensors_with_index(tiny_llama, tmp_path):
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    sharded = tmp_path / "sharded"
    reference.save_pretrained(sharded, max_shard_size="2MB")
    shutil.copy(tiny_llama / "tokenizer.json", sharded)
    shutil.copy(tiny_llama / "tokenizer_config.json", sharded)
    assert (sharded / "model.safetensors.index.json").is_file() and len(list(sharded.glob("*.safetensors"))) > 1
    prompt = list(range(10, 40))
    out = LLM(str(sharded), kv_cache_memory=0.01).generate(
        [prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    )
    assert out[0].outputs[0].token_ids == hf_greedy(reference.eval(), prompt, 8)


def broken_copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_unknown_architecture_names_the_supported_ones(tiny_llama, tmp_path):
    path = broken_copy(tiny_llama, tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="Unsupported architecture 'GPT2LMHeadModel'.*LlamaForCausalLM"):
        LLM(str(path))


def with_config(src, dst, **changes):
    path = broken_copy(src, dst)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **changes}))
    return path


@pytest.mark.parametrize(
    "changes, reason",
    [
        (dict(hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
        (dict(hidden_act="gelu_pytorch_tanh"), "hidden_act 'gelu_pytorch_tanh' is not supported"),
        (
            dict(
                rope_scaling={
                    "rope_type": "longrope",
                    "short_factor": [1.0] * 8,
                    "long_factor": [float(i) for i in range(1, 9)],
                    "original_max_position_embeddings": 48,
                }
            ),
            "rope type 'longrope' changes its frequencies with the sequence's length",
        ),
        (dict(partial_rotary_factor=0.75), "partial_rotary_factor 0.75 rotates part of each head"),
    ],
)
def test_what_the_model_computes_differently_is_refused_at_load(tiny_llama, tmp_path, changes, reason):
    """A config field Pagoda would otherwise ignore, computing something else than the model."""
    with pytest.raises(ConfigError, match=reason):
        LLM(str(with_config(tiny_llama, tmp_path / "m", **changes)), kv_cache_memory=0.01)


def test_a_sliding_window_caps_the_context_only_where_a_layer_slides(tokenizer, tmp_path):
    """Qwen2's window applies to layers from max_window_layers on (transformers' layer_types):
    with every layer below it, attention is full and the context is the model's."""
    path = write_tiny_model("qwen2", tmp_path / "qwen2", tokenizer)
    full = with_config(path, tmp_path / "full", use_sliding_window=True, sliding_window=32, max_window_layers=2)
    assert LLM(str(full), kv_cache_memory=0.01, max_model_len=256).engine.config.model.max_model_len == 256
    sliding = with_config(
        path,
        tmp_path / "sliding",
        use_sliding_window=True,
        sliding_window=32,
        max_window_layers=1,
        layer_types=["full_attention", "sliding_attention"],  # as transformers writes it for these
    )
    with pytest.raises(ConfigError, match="exceeds the model's limit of 32 positions"):
        LLM(str(sliding), kv_cache_memory=0.01, max_model_len=256)


def test_a_missing_weight_is_named_as_the_file_would_name_it(tiny_llama, tmp_path):
    from safetensors.torch import load_file, save_file

    path = broken_copy(tiny_llama, tmp_path / "m")
    weights = load_file(path / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=r"Weights missing from .*: model\.layers\.1\.mlp\.up_proj\.weight$"):
        LLM(str(path), kv_cache_memory=0.01)


def test_missing_weights(tiny_llama, tmp_path):
    path = broken_copy(tiny_llama, tmp_path / "m")
    (path / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match="No \\*.safetensors weights"):
        LLM(str(path))


def test_corrupt_weights(tiny_llama, tmp_path):
    path = broken_copy(tiny_llama, tmp_path / "m")
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ConfigError, match="Cannot read weights"):
        LLM(str(path), kv_cache_memory=0.01)


def test_missing_tokenizer(tiny_llama, tmp_path):
    path = broken_copy(tiny_llama, tmp_path / "m")
    for f in path.glob("tokenizer*"):
        f.unlink()
    with pytest.raises(ConfigError, match="tokenizer"):
        LLM(str(path), kv_cache_memory=0.01)


def test_missing_model_path():
    with pytest.raises(ConfigError, match="not found"):
        LLM("/nonexistent/model")


def test_kv_budget_too_small_for_max_model_len():
    with pytest.raises(ConfigError, match="cannot hold one sequence"):
        LLM(kv_cache_memory=0.001, max_model_len=2048)


def test_a_deleted_llm_is_freed(tiny_llama):
    """Nothing inside the engine keeps it alive once the program drops it (reference cycles are
    collected): its weights and KV pool go back, which on a GPU is device memory."""
    import gc
    import weakref

    llm = LLM(str(tiny_llama), kv_cache_memory=0.05)
    llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=4))
    runner = weakref.ref(llm.engine.core.runner)
    del llm
    gc.collect()
    assert runner() is None


def test_a_gguf_conversion_parses_each_file_once_and_leaves_gguf_as_it_was(tmp_path):
    import gguf

    from pagoda.model_files import _gguf_parsed_once

    path = str(tmp_path / "fields.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_uint32("test.value", 7)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with _gguf_parsed_once():
        reader = gguf.GGUFReader(path)
        assert gguf.GGUFReader(path) is reader and int(reader.fields["test.value"].parts[-1][0]) == 7
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2) is gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
    assert gguf.GGUFReader is reader_class and gguf.get_tensor_name_map is name_map
    assert gguf.GGUFReader(path) is not reader
