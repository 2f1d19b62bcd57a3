"""Model loading: sharded safetensors, and models that cannot be served fail with a reason."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

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


@pytest.mark.parametrize(
    "arch,weight",
    [
        ("phi3", "model.layers.1.self_attn.qkv_proj.weight"),  # fused in the checkpoint, as ours
        ("mixtral", "model.layers.1.block_sparse_moe.experts.2.w3.weight"),  # expert 2's up projection
        ("granitemoe", "model.layers.1.block_sparse_moe.input_linear.weight"),  # every expert's gate and up
        ("granitemoe", "model.layers.0.block_sparse_moe.router.layer.weight"),
    ],
)
def test_a_fused_or_expert_weight_missing_is_named_once_as_its_file_would_name_it(arch, weight, tokenizer, tmp_path):
    from safetensors.torch import load_file, save_file

    path = write_tiny_model(arch, tmp_path / arch, tokenizer)
    weights = load_file(path / "model.safetensors")
    del weights[weight]
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=rf"Weights missing from [^:]*: {re.escape(weight)}$"):
        LLM(str(path), kv_cache_memory=0.01)


@pytest.mark.parametrize(
    "arch,change,reason",
    [
        ("mixtral", {"num_experts_per_tok": 5}, "num_experts_per_tok 5 must be between 1 and the 4 experts"),
        ("qwen3_moe", {"num_experts_per_tok": 0}, "num_experts_per_tok 0 must be between 1"),
        ("qwen3_moe", {"decoder_sparse_step": 0}, "decoder_sparse_step must be at least 1"),
        ("qwen2_moe", {"shared_expert_intermediate_size": 0}, "a shared expert without width"),
    ],
)
def test_a_mixture_transformers_would_not_build_is_refused(arch, change, reason, tokenizer, tmp_path):
    path = write_tiny_model(arch, tmp_path / arch, tokenizer)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | change))
    with pytest.raises(ConfigError, match=reason):
        LLM(str(path), kv_cache_memory=0.01)


def test_a_mixture_reads_its_own_config_keys_only(tokenizer, tmp_path):
    """Keys another family's class reads (Qwen's) change nothing in a Mixtral, as in transformers'."""
    path = write_tiny_model("mixtral", tmp_path / "mixtral", tokenizer)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    prompts = [list(range(100, 130))]
    want = LLM(str(path), kv_cache_memory=0.01).generate(prompts, params)[0].outputs[0].logprobs
    config = json.loads((path / "config.json").read_text())
    qwens = {"norm_topk_prob": False, "moe_intermediate_size": 7, "mlp_only_layers": [0], "decoder_sparse_step": 2}
    (path / "config.json").write_text(json.dumps(config | qwens | {"shared_expert_intermediate_size": 5}))
    assert LLM(str(path), kv_cache_memory=0.01).generate(prompts, params)[0].outputs[0].logprobs == want


def test_an_olmoe_that_clips_its_queries_keys_and_values_is_refused(tokenizer, tmp_path):
    path = write_tiny_model("olmoe", tmp_path / "olmoe", tokenizer)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"clip_qkv": 8.0}))
    with pytest.raises(ConfigError, match="clip_qkv 8.0 clamps the queries, keys and values"):
        LLM(str(path), kv_cache_memory=0.01)


def test_experts_stacked_in_one_weight_load_as_experts_apart(tokenizer, tmp_path):
    """transformers' own layout since version 5 (and its GGUF conversion's): each layer's experts
    in one [experts, out, in] gate_up_proj and one down_proj; the same logprobs as the Hub's."""
    from safetensors.torch import load_file, save_file

    apart = write_tiny_model("qwen3_moe", tmp_path / "apart", tokenizer)
    stacked = Path(shutil.copytree(apart, tmp_path / "stacked"))
    weights = load_file(apart / "model.safetensors")
    experts = "model.layers.1.mlp.experts"  # its sparse layer's
    projections = ("gate_proj", "up_proj", "down_proj")
    mine = [{p: weights.pop(f"{experts}.{e}.{p}.weight") for p in projections} for e in range(4)]  # its 4
    weights[f"{experts}.gate_up_proj"] = torch.stack([torch.cat([m["gate_proj"], m["up_proj"]]) for m in mine])
    weights[f"{experts}.down_proj"] = torch.stack([m["down_proj"] for m in mine])
    save_file(weights, stacked / "model.safetensors", metadata={"format": "pt"})
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)
    prompts = [list(range(100, 140)), [300, 301, 302]]
    want = LLM(str(apart), kv_cache_memory=0.01).generate(prompts, params)
    got = LLM(str(stacked), kv_cache_memory=0.01).generate(prompts, params)
    assert [o.outputs[0].logprobs for o in got] == [o.outputs[0].logprobs for o in want]


def test_a_weight_of_another_shape_is_named_with_both_shapes(tokenizer, tmp_path):
    """A config whose expert width is not the checkpoint's (as a GGUF conversion that drops it)."""
    path = write_tiny_model("qwen3_moe", tmp_path / "moe", tokenizer)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"moe_intermediate_size": 40}))
    pattern = r"has weight 'model\.layers\.1\.mlp\.experts\.0\.\w+_proj\.weight' of shape \[\d+, \d+\], where"
    with pytest.raises(ConfigError, match=pattern):
        LLM(str(path), kv_cache_memory=0.01)


@pytest.mark.parametrize("experts", [3, 5])
def test_a_stack_of_another_number_of_experts_is_named_with_both_shapes(experts, tokenizer, tmp_path):
    from safetensors.torch import load_file, save_file

    path = write_tiny_model("granitemoe", tmp_path / "granitemoe", tokenizer)  # 4 experts, stacked
    weights = load_file(path / "model.safetensors")
    key = "model.layers.1.block_sparse_moe.input_linear.weight"
    stack = weights[key]
    weights[key] = stack[:experts] if experts < len(stack) else torch.cat([stack, stack[:1]])
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    pattern = rf"has weight '{re.escape(key)}' of shape \[{experts}, 256, 64\], where .* makes it \[4, 256, 64\]"
    with pytest.raises(ConfigError, match=pattern):
        LLM(str(path), kv_cache_memory=0.01)


def test_a_qwen_moe_without_experts_is_dense_as_in_transformers(tokenizer, tmp_path):
    """num_experts 0: every layer's MLP dense (decoder_sparse_step then unread), as transformers builds it."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    path = write_tiny_model("qwen2_moe", tmp_path / "moe", tokenizer)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"num_experts": 0, "decoder_sparse_step": 0}))
    dense = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)  # its dense MLPs drawn anew
    weights = {k: v.contiguous() for k, v in dense.state_dict().items()}
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    prompt, params = list(range(100, 120)), SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    got = LLM(str(path), kv_cache_memory=0.01).generate([prompt], params)[0].outputs[0].token_ids
    assert got == hf_greedy(dense, prompt, 6)


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


def _tiny_gguf(
    path, arch: str = "phi3", rotated: int = 16, window: int | None = None, longrope: bool = False, experts: int = 0
) -> str:
    """A GGUF's metadata (16-value heads) and a tensor: what the config conversion reads."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), arch)
    for add, value in (("context_length", 4096), ("block_count", 1), ("feed_forward_length", 128)):
        getattr(writer, f"add_{add}")(value)
    writer.add_embedding_length(64)
    writer.add_head_count(4)
    writer.add_head_count_kv(4)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(rotated)
    writer.add_vocab_size(32)
    if window is not None:
        writer.add_sliding_window(window)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(2)
    if longrope:
        writer.add_tensor("rope_factors_long.weight", np.ones(8, dtype=np.float32))
    writer.add_tensor("token_embd.weight", np.zeros((32, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def test_a_phi3_gguf_keeps_what_transformers_conversion_drops(tmp_path):
    """transformers' phi3 GGUF conversion leaves out the rotary dimension, the sliding window and
    longrope's factors: read from the file, a partial rotation and longrope are refused as from an
    HF directory, and the window caps the context."""
    from transformers import AutoConfig

    from pagoda.model_files import _phi3_metadata, convert_gguf

    with pytest.raises(ConfigError, match="turns 12 of each head's 16 values"):
        convert_gguf(Path(_tiny_gguf(tmp_path / "partial.gguf", rotated=12)), weights=False)
    longrope = Path(_tiny_gguf(tmp_path / "longrope.gguf", longrope=True))
    with pytest.raises(ConfigError, match="rope type 'longrope'"):
        convert_gguf(longrope, weights=False)
    windowed = _tiny_gguf(tmp_path / "windowed.gguf", window=2047)
    config = AutoConfig.from_pretrained(str(tmp_path), gguf_file="windowed.gguf")
    assert config.sliding_window is None  # what transformers gives
    _phi3_metadata(config, Path(windowed))
    assert config.sliding_window == 2047


def test_a_gguf_is_converted_again_by_another_converter(tmp_path, monkeypatch):
    """The converted directory's name changes with the file and with what converts it (this
    converter's version, transformers'), so a directory an earlier converter wrote is not read."""
    import importlib.metadata

    from pagoda import model_files

    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    key = model_files.gguf_cache_key(gguf)
    assert model_files.gguf_cache_key(gguf) == key  # the same file and converter: the same directory
    monkeypatch.setattr(model_files, "GGUF_CONVERTER_VERSION", model_files.GGUF_CONVERTER_VERSION + 1)
    newer = model_files.gguf_cache_key(gguf)
    versions = {"transformers": "99.0"}
    monkeypatch.setattr(importlib.metadata, "version", lambda name: versions.get(name, "0"))
    other_transformers = model_files.gguf_cache_key(gguf)
    gguf.write_bytes(b"GGUF, changed")
    assert len({key, newer, other_transformers, model_files.gguf_cache_key(gguf)}) == 4


def test_a_llama_gguf_with_experts_is_refused_by_name(tmp_path):
    """transformers reads a Mixtral GGUF (llama, with expert_count) as a dense Llama: refused at
    conversion, before any weight is read."""
    from pagoda.model_files import convert_gguf

    with pytest.raises(ConfigError, match="a llama GGUF with 8 experts"):
        convert_gguf(Path(_tiny_gguf(tmp_path / "mixtral.gguf", arch="llama", experts=8)), weights=False)


def test_an_architectures_own_config_keys_only(tokenizer, tmp_path):
    """SmolLM3's no_rope_layers and Granite's multipliers count for those models only, as in
    transformers (a Llama config that carries them is a Llama); a no_rope_layers that does not name
    every layer is refused."""
    from transformers import LlamaConfig

    from pagoda.model_executor.models.decoder import ARCHITECTURES, Dims

    llama = LlamaConfig(num_hidden_layers=2, no_rope_layers=[0, 0], logits_scaling=8.0, residual_multiplier=0.5)
    dims = Dims.from_hf(llama, ARCHITECTURES["LlamaForCausalLM"])
    assert dims.rotated == (True, True) and (dims.logits_scaling, dims.residual_multiplier) == (1.0, 1.0)
    path = write_tiny_model("smollm3", tmp_path / "smollm3", tokenizer)
    with pytest.raises(ConfigError, match="no_rope_layers names 1 layers; the model has 2"):
        LLM(str(with_config(path, tmp_path / "short", no_rope_layers=[1])), kv_cache_memory=0.01)
