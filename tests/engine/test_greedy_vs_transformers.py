"""Greedy output of the default model equals transformers' token for token (fp32, CPU), at
concurrency 1 and 32, with split prefills and with a KV pool small enough to force preemption."""

from __future__ import annotations

import pytest

from pagoda import LLM, SamplingParams
from tests.reference import assert_greedy_match, hf_greedy

pytestmark = pytest.mark.slow

MAX_NEW = 24
TEXTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "List three primary colors:",
    "Translate to French: Good morning, my friend.",
    "Explain why the sky is blue in one sentence.",
]


def build_prompts(tokenizer) -> list[list[int]]:
    from pagoda.model_files import apply_chat_template

    prompts = [tokenizer.encode(t) for t in TEXTS]
    prompts += [apply_chat_template(tokenizer, [{"role": "user", "content": t}]) for t in TEXTS[:3]]
    story = tokenizer.encode(
        " ".join(
            f"Chapter {i}: the travellers walked on through the valley of {w}."
            for i, w in enumerate(["rain", "stone", "glass", "salt", "ash", "fire", "ice"] * 12)
        )
    )
    # block-boundary lengths (block 16) and prompts longer than a prefill chunk
    prompts += [story[:n] for n in (15, 16, 17, 32, 33, 130, 400, 700)]
    return prompts


def run_checked(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    """All prompts in flight at once, the KV integrity invariant checked after every step."""
    engine = llm.engine
    ids = [engine.add_request(p, params) for p in prompts]
    results: dict[str, list[int]] = {}
    while engine.has_unfinished:
        for update in engine.step():
            if update.finished:
                results[update.request_id] = update.token_ids
        engine.core.check_integrity()
    assert not engine.core.scheduler.running and not engine.core.scheduler.waiting
    return [results[i] for i in ids]


@pytest.fixture(scope="module")
def prompts(default_llm):
    return build_prompts(default_llm.tokenizer)


@pytest.fixture(scope="module")
def reference(hf_reference, prompts, default_llm):
    eos = default_llm.engine.config.model.eos_token_ids
    return [hf_greedy(hf_reference, p, MAX_NEW, eos) for p in prompts]


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)


def check_all(hf_reference, prompts, reference, outputs):
    report: list[str] = []
    for p, expected, actual in zip(prompts, reference, outputs):
        assert_greedy_match(hf_reference, p, expected, actual, report)
    if report:
        print("\n".join(report))


def test_concurrency_32(default_llm, hf_reference, prompts, reference):
    many = (prompts * 2)[:32]
    outputs = run_checked(default_llm, many, GREEDY)
    check_all(hf_reference, many, (reference * 2)[:32], outputs)


def test_concurrency_1(default_llm, hf_reference, prompts, reference):
    outputs = [run_checked(default_llm, [p], GREEDY)[0] for p in prompts]
    check_all(hf_reference, prompts, reference, outputs)


def test_split_prefill_and_preemption(hf_reference, prompts, reference):
    llm = LLM(max_model_len=768, max_num_batched_tokens=48, kv_cache_memory=0.036)
    pool_tokens = llm.engine.core.scheduler.kv.pool.capacity * llm.engine.config.cache.block_size
    assert pool_tokens < sum(len(p) for p in prompts)  # the pool cannot hold them all at once
    outputs = run_checked(llm, prompts, GREEDY)
    check_all(hf_reference, prompts, reference, outputs)
    assert llm.engine.core.stats().num_preemptions > 0


def test_split_prefill_without_prefix_cache(hf_reference, prompts, reference):
    llm = LLM(max_model_len=768, max_num_batched_tokens=96, kv_cache_memory=0.036, enable_prefix_caching=False)
    outputs = run_checked(llm, prompts, GREEDY)
    check_all(hf_reference, prompts, reference, outputs)
    assert llm.engine.core.stats().num_preemptions > 0
