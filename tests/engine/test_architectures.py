"""Every supported architecture, as a tiny random model: greedy tokens equal transformers',
with whole and split prefills."""

from __future__ import annotations

import pytest
import torch

from pagoda import LLM, SamplingParams
from tests.reference import assert_greedy_match, hf_greedy
from tests.tiny_models import ARCH_CONFIGS, write_tiny_model


@pytest.fixture(scope="module")
def tokenizer():
    from pagoda.model_files import load_tokenizer

    return load_tokenizer(None)


@pytest.mark.parametrize("arch", sorted(ARCH_CONFIGS))
def test_tiny_model_matches_transformers(arch, tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM

    path = write_tiny_model(arch, tmp_path / arch, tokenizer, tie_word_embeddings=arch == "qwen3")
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, len(tokenizer), (n,), generator=gen).tolist() for n in (5, 16, 33, 90)]
    expected = [hf_greedy(reference, p, 12) for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    report: list[str] = []
    for chunk in (512, 8):
        llm = LLM(str(path), max_num_batched_tokens=chunk, kv_cache_memory=0.01, block_size=16)
        outputs = llm.generate(prompts, params)
        for p, want, got in zip(prompts, expected, outputs):
            assert_greedy_match(reference, p, want, got.outputs[0].token_ids, report)
    print("\n".join(report))
