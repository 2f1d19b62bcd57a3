"""LoRA adapters offline: PEFT adapters on tiny random models, against PEFT's own forward through
`transformers` (greedy, token for token); base rows untouched beside adapter rows in one batch;
the prefix cache kept apart per adapter; adapters that cannot be served refused by name."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from pagoda import LLM, LoRARequest, SamplingParams
from pagoda.lora import LoRAError
from tests.tiny_models import write_tiny_model

peft = pytest.importorskip("peft")

PROMPTS = [[1, 520, 3000, 44, 901, 77], [1, 1200, 15, 9000], [1, 77, 77, 3, 4050, 600, 31, 2]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
ADAPTERS = {  # name: PEFT LoraConfig keywords
    "some": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]),
    "all": dict(
        r=4,
        lora_alpha=8,
        use_rslora=True,
        alpha_pattern={"down_proj|up_proj": 3.0},  # a key is a regular expression (PEFT's)
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    ),
}


def write_adapter(base, folder: Path, seed: int, **config) -> Path:
    """A PEFT adapter of `base` with random A and B (PEFT starts B at zero: no change to see)."""
    model = peft.get_peft_model(base, peft.LoraConfig(lora_dropout=0.0, **config))
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_(0, 0.2)
    model.save_pretrained(folder)
    return folder


def reference(model_dir: Path, adapter: Path | None) -> list[list[int]]:
    """PEFT's greedy tokens for PROMPTS (the base model's where `adapter` is None)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter)
    model.eval()
    outs = []
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        generated = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
        outs.append(generated[0, len(prompt) :].tolist())
    return outs


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def setup(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from pagoda.model_files import load_tokenizer

    folder = tmp_path_factory.mktemp(f"lora_{request.param}")
    model_dir = write_tiny_model(request.param, folder / "model", load_tokenizer(None))
    adapters = {
        name: write_adapter(AutoModelForCausalLM.from_pretrained(model_dir), folder / name, seed, **config)
        for seed, (name, config) in enumerate(ADAPTERS.items())
    }
    llm = LLM(str(model_dir), enable_lora=True, max_model_len=256, kv_cache_memory=0.05, max_num_batched_tokens=64)
    yield model_dir, adapters, llm
    llm.engine.close()


def tokens(llm: LLM, prompts, loras) -> list[list[int]]:
    return [list(r.outputs[0].token_ids) for r in llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)]


def test_adapters_give_peft_greedy_tokens_in_a_mixed_batch(setup):
    """Each prompt under each adapter and under none, all in one batch: each as PEFT computes it."""
    model_dir, adapters, llm = setup
    requests = {name: LoRARequest(name, i, str(path)) for i, (name, path) in enumerate(adapters.items(), start=1)}
    want = {name: reference(model_dir, adapters.get(name)) for name in (*adapters, None)}
    assert want["some"] != want[None] and want["all"] != want[None]  # the adapters change the outputs
    batch = [(p, name) for name in (None, *adapters) for p in range(len(PROMPTS))]
    loras = [requests.get(name) for _, name in batch]
    results = llm.generate([PROMPTS[p] for p, _ in batch], GREEDY, use_tqdm=False, lora_request=loras)
    for (p, name), result, lora in zip(batch, results, loras):
        assert result.outputs[0].token_ids == want[name][p], f"prompt {p}, adapter {name}"
        assert result.lora_request is lora


def test_the_prefix_cache_keeps_adapters_apart(setup):
    """A prompt cached under one adapter is computed again under another (its KV differs), and hit
    again under the same one, with the same tokens either way."""
    _, adapters, llm = setup
    some, every = (LoRARequest(name, i, str(path)) for i, (name, path) in enumerate(adapters.items(), start=1))
    prompt = list(range(100, 180))  # five blocks of 16
    runs = [llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=lora)[0] for lora in (None, some, every, some)]
    cached = [run.num_cached_tokens for run in runs]
    assert cached[:3] == [0, 0, 0] and cached[3] >= 64, cached
    assert runs[3].outputs[0].token_ids == runs[1].outputs[0].token_ids
    assert runs[1].outputs[0].token_ids != runs[0].outputs[0].token_ids


def test_adapters_that_cannot_be_served_are_refused_by_name(setup, tmp_path):
    model_dir, adapters, llm = setup
    source = adapters["some"]
    with pytest.raises(LoRAError, match="no adapter_config.json"):
        llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False, lora_request=LoRARequest("gone", 90, str(tmp_path)))
    config = json.loads((source / "adapter_config.json").read_text())
    for name, change, message in [
        ("dora", {"use_dora": True}, "use_dora True is not supported"),
        ("saved", {"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ("pissa", {"init_lora_weights": "pissa"}, "init_lora_weights 'pissa'"),
    ]:
        folder = tmp_path / name
        folder.mkdir()
        (folder / "adapter_config.json").write_text(json.dumps({**config, **change}))
        (folder / "adapter_model.safetensors").write_bytes((source / "adapter_model.safetensors").read_bytes())
        with pytest.raises(LoRAError, match=message):
            llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False, lora_request=LoRARequest(name, 91, str(folder)))
    from safetensors.torch import load_file, save_file

    head = tmp_path / "head"
    head.mkdir()
    (head / "adapter_config.json").write_text(json.dumps(config))
    tensors = load_file(source / "adapter_model.safetensors")
    save_file(
        {**tensors, "base_model.model.lm_head.lora_A.weight": torch.zeros(8, 64)}, head / "adapter_model.safetensors"
    )
    with pytest.raises(LoRAError, match="changes the LM head or the embeddings"):
        llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False, lora_request=LoRARequest("head", 92, str(head)))
    small = LLM(str(model_dir), enable_lora=True, max_lora_rank=4, max_model_len=64, kv_cache_memory=0.01)
    with pytest.raises(LoRAError, match="rank 8, above max_lora_rank 4"):
        small.generate([PROMPTS[0]], GREEDY, use_tqdm=False, lora_request=LoRARequest("some", 1, str(source)))
    small.engine.close()
    with pytest.raises(LoRAError, match="start it with enable_lora"):
        plain = LLM(str(model_dir), max_model_len=64, kv_cache_memory=0.01)
        try:
            plain.generate([PROMPTS[0]], GREEDY, use_tqdm=False, lora_request=LoRARequest("some", 1, str(source)))
        finally:
            plain.engine.close()
    for kwargs, message in [
        ({"lora_int_id": 0}, "lora_int_id"),
        ({"lora_path": ""}, "empty"),
        ({"load_inplace": True}, "new id"),
    ]:
        with pytest.raises(ValueError, match=message):
            LoRARequest(**{"lora_name": "x", "lora_int_id": 1, "lora_path": str(source), **kwargs})


def test_adapters_on_torchs_linears_too(setup):
    """Without deterministic serving the updates run on torch's GEMM (not the batch-invariant one)."""
    model_dir, adapters, _ = setup
    llm = LLM(str(model_dir), enable_lora=True, deterministic=False, max_model_len=64, kv_cache_memory=0.01)
    try:
        lora = LoRARequest("some", 1, str(adapters["some"]))
        assert tokens(llm, PROMPTS, lora) == reference(model_dir, adapters["some"])
    finally:
        llm.engine.close()


def test_pagoda_generate_runs_an_adapter(setup, capsys):
    from pagoda.entrypoints import generate

    model_dir, adapters, llm = setup
    argv = ["hello there", "--model", str(model_dir), "--enable-lora", "--lora-path", str(adapters["some"])]
    code = generate.main([*argv, "--max-tokens", "5", "--json", "--max-model-len", "64", "--kv-cache-memory", "0.01"])
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    lora = LoRARequest("some", 1, str(adapters["some"]))
    want = llm.generate(["hello there"], SamplingParams(temperature=0.0, max_tokens=5), False, lora)[0].outputs[0]
    assert code == 0 and printed["text"] == want.text


def test_max_cpu_loras_holds_the_least_recently_used_adapter_out(setup, caplog):
    """With max_cpu_loras=1 (and vLLM's max_loras keyword, accepted), adapters taken in turn are
    each read again at their next use and still give PEFT's tokens; a batch alternating both runs
    both, reading each at most once (a read a request still runs is taken back, not read again),
    and after it the model holds one adapter's weights, not every read's."""
    model_dir, adapters, _ = setup
    llm = LLM(str(model_dir), enable_lora=True, max_loras=2, max_cpu_loras=1, max_model_len=256, kv_cache_memory=0.05)
    try:
        requests = {name: LoRARequest(name, i, str(path)) for i, (name, path) in enumerate(adapters.items(), start=1)}
        want = {name: reference(model_dir, path) for name, path in adapters.items()}
        lora_model = llm.engine.core.runner.lora
        reads = []
        for name in ("some", "all", "some"):
            assert tokens(llm, PROMPTS, requests[name]) == want[name], name
            reads.append(llm.engine.adapter(requests[name]).uid)
            assert lora_model.registered == {reads[-1]}
        assert reads[0] != reads[2]  # dropped for "all", then read again
        batch = [requests[name] for _ in PROMPTS for name in ("some", "all")]  # alternating
        with caplog.at_level(logging.INFO, logger="pagoda.engine.base"):
            out = tokens(llm, [p for p in PROMPTS for _ in range(2)], batch)
        assert out == [w for pair in zip(want["some"], want["all"]) for w in pair]
        reads = [r.getMessage() for r in caplog.records if r.getMessage().endswith(") read")]
        assert len(reads) == 1 and "'all'" in reads[0], reads  # "some" was held; "all" read once
        assert len(lora_model.registered) == 1
    finally:
        llm.engine.close()


def test_a_forgotten_adapter_is_read_again_and_its_old_kv_never_served(setup, tmp_path):
    """An id's adapter is read once: new files in its folder change nothing until the engine
    forgets it; then the id's next use reads them, and a prompt cached under the old weights is
    computed again (the prefix cache keys KV by the weights read, not by the id)."""
    model_dir, adapters, llm = setup
    folder = tmp_path / "swapped"
    folder.mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (folder / name).write_bytes((adapters["some"] / name).read_bytes())
    lora = LoRARequest("swapped", 50, str(folder))
    prompt = [1, *range(300, 340)]  # two whole blocks and more
    first = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=lora)[0]
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (folder / name).write_bytes((adapters["all"] / name).read_bytes())
    again = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=lora)[0]
    assert again.outputs[0].token_ids == first.outputs[0].token_ids and again.num_cached_tokens >= 32
    llm.engine.forget_adapter(50)
    swapped = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=lora)[0]
    every = LoRARequest("all-fresh", 51, str(adapters["all"]))
    want = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=every)[0]
    assert swapped.num_cached_tokens == 0 and swapped.outputs[0].token_ids == want.outputs[0].token_ids
    assert swapped.outputs[0].token_ids != first.outputs[0].token_ids


def adapter_of_a_tiny_model(arch: str, tmp_path: Path, name: str, seed: int, **config):
    """(model dir, adapter dir, PEFT's tokens with it, an LLM with LoRA on) for a tiny `arch` model
    and an adapter of `config` that changes its tokens."""
    from transformers import AutoModelForCausalLM

    from pagoda.model_files import load_tokenizer

    model_dir = write_tiny_model(arch, tmp_path / "model", load_tokenizer(None))
    adapter = write_adapter(AutoModelForCausalLM.from_pretrained(model_dir), tmp_path / name, seed, **config)
    want = reference(model_dir, adapter)
    assert want != reference(model_dir, None)
    llm = LLM(str(model_dir), enable_lora=True, max_model_len=256, kv_cache_memory=0.05)
    return model_dir, adapter, want, llm


def test_an_adapter_of_phi3s_fused_projections(tmp_path):
    """PEFT names Phi-3's own fused modules (qkv_proj, gate_up_proj): an adapter of them covers the
    whole projection, as PEFT computes it."""
    config = dict(r=4, lora_alpha=8, target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"])
    _, adapter, want, llm = adapter_of_a_tiny_model("phi3", tmp_path, "fused", 3, **config)
    try:
        assert tokens(llm, PROMPTS, LoRARequest("fused", 1, str(adapter))) == want
    finally:
        llm.engine.close()


def test_adapters_of_a_mixture_of_experts_attention_and_its_dense_layers(tmp_path):
    """On a mixture of experts (the tiny qwen2_moe: layer 0 sparse, layer 1 dense), an adapter of
    the attention and of the dense layer's MLP gives PEFT's tokens; one of a sparse layer's MLP is
    refused by name (Pagoda applies no LoRA to experts)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    config = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"])
    config |= dict(layers_to_transform=[1])  # PEFT: the dense layer's gate_proj, not the shared expert's
    model_dir, adapter, want, llm = adapter_of_a_tiny_model("qwen2_moe", tmp_path, "dense", 5, **config)
    try:
        assert tokens(llm, PROMPTS, LoRARequest("dense", 1, str(adapter))) == want
        sparse = tmp_path / "sparse"  # the same adapter moved onto layer 0, whose MLP is the mixture
        sparse.mkdir()
        (sparse / "adapter_config.json").write_text((adapter / "adapter_config.json").read_text())
        weights = load_file(adapter / "adapter_model.safetensors")
        moved = {k.replace("layers.1.", "layers.0."): v for k, v in weights.items()}
        save_file(moved, sparse / "adapter_model.safetensors")
        with pytest.raises(LoRAError, match=r"MLP of layer 0 \(.*layers\.0\.mlp\.\w+_proj.*\), a mixture of experts"):
            tokens(llm, PROMPTS[:1], LoRARequest("sparse", 2, str(sparse)))
        # PEFT's gate_proj of every layer: the dense layer's, and layer 0's shared expert's
        every = dict(r=4, lora_alpha=8, target_modules=["gate_proj"])
        shared = write_adapter(AutoModelForCausalLM.from_pretrained(model_dir), tmp_path / "shared", 6, **every)
        with pytest.raises(LoRAError, match=r"MLP of layer 0 \(.*layers\.0\.mlp\.shared_expert\.gate_proj.*mixture"):
            tokens(llm, PROMPTS[:1], LoRARequest("shared", 3, str(shared)))
    finally:
        llm.engine.close()
