"""The prefix cache never changes outputs: on randomized workloads with a real (tiny) model,
greedy outputs with the cache on equal those with it off, while the pool is small enough to
force eviction and preemption; the KV integrity invariant is checked after every step."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagoda import LLM, SamplingParams
from tests.reference import assert_greedy_match
from tests.tiny_models import write_tiny_model

MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from pagoda.model_files import load_tokenizer

    path = write_tiny_model("qwen2", tmp_path_factory.mktemp("tiny") / "qwen2", load_tokenizer(None))
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    # 24 blocks of 16 tokens (a block: K and V, 16 tokens, 2 kv heads of 16 dims, fp32, 2 layers):
    # a few requests at a time; the rest wait, get preempted or evict the cache
    block_bytes = 2 * 16 * 2 * 16 * 4 * 2
    engines = {
        cache: LLM(
            str(path),
            max_model_len=MAX_MODEL_LEN,
            kv_cache_memory=24 * block_bytes / 2**30,
            max_num_batched_tokens=64,
            enable_prefix_caching=cache,
        )
        for cache in (True, False)
    }
    return engines, reference


def run(llm: LLM, prompts, params, abort_at: dict[int, int]) -> dict[int, list[int]]:
    """All requests in flight; request i is aborted after step abort_at[i]. Integrity every step."""
    engine = llm.engine
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    outputs: dict[int, list[int]] = {}
    step = 0
    while engine.has_unfinished:
        for update in engine.step():
            if update.finished:
                outputs.setdefault(ids.index(update.request_id), []).append(update.token_ids)
        step += 1
        for i, at in abort_at.items():
            if at == step:
                engine.core.finish_requests([f"{ids[i]}#{k}" for k in range(params[i].n)], "abort")
                for k in range(params[i].n):
                    engine.outputs.drop(f"{ids[i]}#{k}")
        engine.core.check_integrity()
    assert engine.core.scheduler.kv.usage == 0.0
    return {i: seqs for i, seqs in outputs.items() if i not in abort_at}


@st.composite
def workloads(draw):
    rng = random.Random(draw(st.integers(0, 2**32)))
    prefixes = [[rng.randrange(3, 1000) for _ in range(rng.randint(1, 80))] for _ in range(draw(st.integers(1, 3)))]
    count = draw(st.integers(2, 8))
    prompts, params = [], []
    for _ in range(count):
        prompt = rng.choice(prefixes) + [rng.randrange(3, 1000) for _ in range(rng.randint(1, 40))]
        prompts.append(prompt)
        params.append(
            SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 24), ignore_eos=True, n=rng.choice([1, 1, 2]))
        )
    aborts = {i: rng.randint(1, 6) for i in range(count) if rng.random() < 0.2}
    return prompts, params, aborts


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(workload=workloads())
def test_cache_on_equals_cache_off(tiny, workload):
    (engines, reference), (prompts, params, aborts) = tiny, workload
    with_cache = run(engines[True], prompts, params, aborts)
    without = run(engines[False], prompts, params, aborts)
    report: list[str] = []
    for i, seqs in without.items():
        # aborts land on different steps in the two runs, so compare only requests that finished in both
        if i in with_cache:
            for expected, actual in zip(seqs, with_cache[i]):
                assert_greedy_match(reference, prompts[i], expected, actual, report)
    preemptions = engines[True].engine.core.stats().num_preemptions
    print(f"preemptions so far {preemptions}; {report}")
