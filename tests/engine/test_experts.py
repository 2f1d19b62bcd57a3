"""A mixture of experts' block against transformers' own, on the same weights and rows: bitwise in
float32 and bfloat16 (the routing weights' dtype, each row's sum in its experts' order, one rounded
addition at a time), with 2 or 3 experts a row."""

from __future__ import annotations

import pytest
import torch

from tests.tiny_models import write_tiny_model


@pytest.fixture(scope="module")
def tokenizer():
    from pagoda.model_files import load_tokenizer

    return load_tokenizer(None)


def blocks(path, dtype):
    """(ours, transformers') mixture block of the model's first sparse layer, in `dtype`, plain
    torch modules on both sides (no C kernels: the block's own arithmetic)."""
    from transformers import AutoModelForCausalLM

    from pagoda.attention.torch_backend import TorchAttentionBackend
    from pagoda.model_executor.loader import load_model_config, load_weights
    from pagoda.model_executor.models.decoder import ARCHITECTURES, DecoderModel

    config = load_model_config(str(path), "tiny", str(dtype).removeprefix("torch."), None, torch.device("cpu"))
    ours = DecoderModel(
        config.hf_config, ARCHITECTURES[config.architecture], TorchAttentionBackend(), 64, dtype, torch.device("cpu")
    )
    load_weights(ours, config)
    layer = config.expert_layers[0]
    theirs = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).model.layers[layer]
    return ours.layers[layer].mlp, getattr(theirs, "block_sparse_moe", None) or theirs.mlp


# qwen2_moe's shared expert gate is a softmax of (g, 0) here, sigmoid(g) there: the same to an ulp
@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "granitemoe", "olmoe"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_mixture_block_equals_transformers_bitwise(arch, dtype, tokenizer, tmp_path):
    ours, theirs = blocks(write_tiny_model(arch, tmp_path / arch, tokenizer), dtype)
    x = torch.randn(1, 300, ours.gate.weight.shape[1], generator=torch.Generator().manual_seed(2)).to(dtype)
    with torch.no_grad():
        want = theirs(x)
        want = want[0] if isinstance(want, tuple) else want
        assert torch.equal(ours(x[0]), want[0])


def test_the_experts_in_grouped_c_calls_equal_one_module_call_each(tokenizer, tmp_path):
    """Deterministic serving's experts (InvariantExperts: every expert's projection in one C call)
    give the bits of one module call per expert, on a step's worth of rows."""
    from pagoda import LLM
    from pagoda.model_executor.cpu_invariant import InvariantExperts

    llm = LLM(str(write_tiny_model("olmoe", tmp_path / "olmoe", tokenizer)), kv_cache_memory=0.01)
    moe = llm.engine.core.runner.model.layers[0].mlp
    assert isinstance(moe.grouped, InvariantExperts)
    x = torch.randn(77, llm.engine.config.model.hf_config.hidden_size, generator=torch.Generator().manual_seed(3))
    grouped = moe(x)
    moe.grouped = None
    assert torch.equal(grouped, moe(x))
