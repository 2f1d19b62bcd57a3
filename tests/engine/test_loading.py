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
