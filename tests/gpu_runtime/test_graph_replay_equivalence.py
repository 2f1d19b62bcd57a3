"""Greedy outputs are the same through the graph runner as eagerly, with the Triton backend under
Triton's interpreter on CPU. capture=False replays each bucket's forward eagerly on the static
buffers with the capture-time metadata (contexts at max_model_len, so split-KV is on), which is
everything a CUDA graph fixes except the addresses; the capture itself is checked on a GPU by
benchmarks/gpu_engine.py."""

from __future__ import annotations

import pytest

from pagoda import LLM, SamplingParams
from tests.reference import assert_greedy_match, hf_greedy

pytestmark = pytest.mark.slow

PROMPT_LENGTHS = (3, 17, 20, 9, 26)  # 5 decodes: bucket 8 with 3 padded lanes, then 4, 2, 1 as they finish
MAX_TOKENS = (7, 5, 8, 3, 6)


@pytest.fixture(scope="module")
def prompts():
    return [list(range(100 + 7 * i, 100 + 7 * i + n)) for i, n in enumerate(PROMPT_LENGTHS)]


@pytest.fixture(scope="module")
def reference(tiny_llama, prompts):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    return model, [hf_greedy(model, p, n) for p, n in zip(prompts, MAX_TOKENS)]


def generate(llm: LLM, prompts) -> list[list[int]]:
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def test_graph_runner_matches_eager_and_transformers(tiny_llama, prompts, reference):
    # small token budget: prefills are chunked beside running decodes, so mixed steps run eagerly
    llm = LLM(
        str(tiny_llama),
        attention_backend="triton",
        kv_cache_memory=0.01,
        max_model_len=512,
        max_num_seqs=8,
        max_num_batched_tokens=24,
    )
    eager = generate(llm, prompts)

    runner = llm.engine.core.runner
    runner.cuda_graphs = runner.make_graph_runner(capture=False)
    runner.cuda_graphs.capture()
    assert runner.cuda_graphs.sizes == (1, 2, 4, 8)
    replayed = []
    replay = runner.cuda_graphs.replay
    runner.cuda_graphs.replay = lambda ids, pos, inputs: replayed.append(inputs.num_reqs) or replay(ids, pos, inputs)
    graphs = generate(llm, prompts)

    assert {5, 4, 1} <= set(replayed), replayed  # padded buckets were used
    assert graphs == eager
    model, expected = reference
    report: list[str] = []
    for prompt, want, got in zip(prompts, expected, graphs):
        assert_greedy_match(model, prompt, want, got, report)
