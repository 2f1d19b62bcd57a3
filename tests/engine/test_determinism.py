"""Deterministic serving: a request's tokens and logprobs (sampled, prompt and top alternatives) are
bitwise equal (`==`, no tolerance) whether it runs alone or among 2 to 32 others of different
lengths, whatever the prefill chunk size, with the prefix cache cold or warm, and across a
preemption; on the default model and the tiny model of each architecture. Seeded sampling draws
the same tokens whatever the batch."""

from __future__ import annotations

import random

import pytest

from pagoda import LLM, SamplingParams
from pagoda.errors import ConfigError
from tests.tiny_models import ARCH_CONFIGS, write_tiny_model

MAX_NEW = 8


def fingerprint(output) -> tuple:
    """Everything a request's result says about its numbers: compared with ==."""
    seq = output.outputs[0]
    return seq.token_ids, seq.logprobs, output.prompt_logprobs


def params_for(i: int, seeded: bool = False) -> SamplingParams:
    prompt_logprobs = 2 if i % 3 == 0 else None
    if seeded:
        return SamplingParams(
            temperature=0.9, top_p=0.95, top_k=50, seed=100 + i, max_tokens=MAX_NEW, logprobs=2, ignore_eos=True
        )
    return SamplingParams(
        temperature=0.0, max_tokens=MAX_NEW, logprobs=3, prompt_logprobs=prompt_logprobs, ignore_eos=True
    )


def solo(llm: LLM, prompts, seeded: bool = False, indices=None) -> list[tuple]:
    """Each prompt alone (with the parameters of its index), the prefix cache emptied before each."""
    results = []
    for i, prompt in zip(indices or range(len(prompts)), prompts):
        llm.engine.core.reset_prefix_cache()
        results.append(fingerprint(llm.generate([prompt], params_for(i, seeded), use_tqdm=False)[0]))
    return results


def together(llm: LLM, prompts, indices, seeded: bool = False) -> list[tuple]:
    """The prompts at `indices`, all in flight at once."""
    outputs = llm.generate([prompts[i] for i in indices], [params_for(i, seeded) for i in indices], use_tqdm=False)
    return [fingerprint(o) for o in outputs]


def assert_equal_to_solo(reference, indices, results) -> None:
    for i, result in zip(indices, results):
        assert result == reference[i], f"prompt {i} differs from its solo run"


# ---- the default model ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def prompts(default_llm) -> list[list[int]]:
    story = default_llm.tokenizer.encode(
        " ".join(
            f"Chapter {i}: the travellers walked on through the valley of {w}."
            for i, w in enumerate(["rain", "stone", "glass", "salt", "ash", "fire", "ice"] * 12)
        )
    )
    lengths = [3, 9, 15, 16, 17, 31, 40, 64, 90, 130, 200, 257, 300, 400]  # across blocks and 256-token spans
    distinct = [story[7 * i + 1 : 7 * i + 1 + n] for i, n in enumerate(lengths)]
    return distinct + [story[:n] for n in (20, 100, 280)]  # these three share their opening: cache hits


def engine(**overrides) -> LLM:
    args = dict(max_model_len=1024, kv_cache_memory=0.2, deterministic=True) | overrides
    return LLM(**args)


@pytest.fixture(scope="module")
def reference(prompts) -> list[tuple]:
    """Each prompt alone, its whole prompt in one step, no prefix cache."""
    llm = engine(max_num_batched_tokens=1024, enable_prefix_caching=False)
    return solo(llm, prompts)


def test_default_model_is_deterministic_by_default(default_llm):
    from pagoda.engine.args import DETERMINISTIC_BY_DEFAULT

    assert default_llm.engine.config.deterministic is DETERMINISTIC_BY_DEFAULT


@pytest.fixture(scope="module")
def batch_llm(default_llm) -> LLM:
    """The shared default engine where it is deterministic by default, else one that is."""
    return default_llm if default_llm.engine.config.deterministic else engine(max_model_len=2048, kv_cache_memory=0.5)


@pytest.mark.parametrize("size", [2, 5, 32])
def test_batches_equal_solo(batch_llm, prompts, reference, size):
    """Batches of different lengths, (for 32) some prompts twice, mixing prefills and decodes."""
    rng = random.Random(size)
    indices = (
        [rng.randrange(len(prompts)) for _ in range(size)]
        if size > len(prompts)
        else rng.sample(range(len(prompts)), size)
    )
    assert_equal_to_solo(reference, indices, together(batch_llm, prompts, indices))


@pytest.mark.parametrize("budget", [29, 61])
def test_chunked_prefill_equals_solo(prompts, reference, budget):
    llm = engine(max_num_batched_tokens=budget, enable_prefix_caching=False)
    indices = list(range(len(prompts)))
    assert_equal_to_solo(reference, indices, together(llm, prompts, indices))


def test_prefix_cache_cold_and_warm_equal_solo(prompts, reference):
    llm = engine(max_num_batched_tokens=128)
    indices = list(range(len(prompts)))
    cold = llm.generate(prompts, [params_for(i) for i in indices], use_tqdm=False)
    warm = llm.generate(prompts, [params_for(i) for i in indices], use_tqdm=False)
    assert sum(o.num_cached_tokens for o in warm) > sum(o.num_cached_tokens for o in cold)
    assert_equal_to_solo(reference, indices, [fingerprint(o) for o in cold])
    assert_equal_to_solo(reference, indices, [fingerprint(o) for o in warm])


def test_preemption_equals_solo(prompts, reference):
    # 34 blocks (528 tokens) for ~1,900 prompt tokens: requests are preempted
    llm = engine(max_num_batched_tokens=48, kv_cache_memory=34 * 737280 / 2**30, max_model_len=512)
    indices = list(range(len(prompts)))
    assert_equal_to_solo(reference, indices, together(llm, prompts, indices))
    assert llm.engine.core.stats().num_preemptions > 0


def test_seeded_sampling_equals_solo(prompts, reference):
    llm = engine(max_num_batched_tokens=64)
    indices = [0, 3, 7, 10, 12, 15]
    alone = solo(llm, [prompts[i] for i in indices], seeded=True, indices=indices)
    batch = [i for i in range(len(prompts)) for _ in (0, 1)]  # each twice, the seeded request among greedy ones
    outputs = llm.generate(
        [prompts[i] for i in batch], [params_for(i, seeded=k % 2 == 0) for k, i in enumerate(batch)], use_tqdm=False
    )
    sampled = {i: fingerprint(o) for k, (i, o) in enumerate(zip(batch, outputs)) if k % 2 == 0}
    assert [sampled[i] for i in indices] == alone
    assert any(alone[j][0] != reference[i][0] for j, i in enumerate(indices))  # it did sample


# ---- tiny models of each architecture ---------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    from pagoda.model_files import load_tokenizer

    return load_tokenizer(None)


@pytest.mark.parametrize("arch", sorted(ARCH_CONFIGS))
def test_tiny_models(arch, tokenizer, tmp_path):
    """Chunks of 64 tokens shared among the batch, a pool small enough to preempt, the cache warm
    on the second pass: every result equal to the request's own run alone."""
    path = write_tiny_model(arch, tmp_path / arch, tokenizer)
    rng = random.Random(arch)
    prompts = [[rng.randrange(3, 1000) for _ in range(n)] for n in (1, 7, 16, 33, 90, 180, 270, 300)]
    prompts += [prompts[-1][:n] + [5, 6] for n in (40, 260)]  # sharing a prefix with another prompt
    head_dim = ARCH_CONFIGS[arch][1].get("head_dim", 16)
    pool = 34 * 2 * 16 * 2 * head_dim * 4 * 2 / 2**30  # 34 blocks (K and V, 16 tokens, 2 kv heads, 2 layers)
    llm = LLM(str(path), max_model_len=512, max_num_batched_tokens=64, kv_cache_memory=pool, deterministic=True)
    reference = solo(llm, prompts)
    indices = list(range(len(prompts)))
    for _ in ("cold", "warm"):
        assert_equal_to_solo(reference, indices, together(llm, prompts, indices))
    assert llm.engine.core.stats().num_preemptions > 0


# ---- what the mode refuses ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides,reason",
    [
        (dict(dtype="bfloat16"), "float32 only"),
        (dict(attention_backend="torch"), "attention backend is not batch-invariant"),
    ],
)
def test_refused_where_it_cannot_hold(overrides, reason):
    from pagoda.engine.args import EngineArgs

    with pytest.raises(ConfigError, match=reason):
        EngineArgs(deterministic=True, **overrides).create_config()
    assert not EngineArgs(**overrides).create_config().deterministic  # by default: off, not refused
    assert not EngineArgs(deterministic=False).create_config().deterministic


def test_the_refusal_says_why_the_cpu_backend_cannot_serve_either():
    """A model the cpu backend refuses (head_dim 12) runs on torch, which is not batch-invariant:
    the reason names the cpu backend's own refusal instead of advising it."""
    import torch

    from pagoda.attention import selector
    from pagoda.model_executor.cpu_invariant import unsupported_reason

    cpu, fp32 = torch.device("cpu"), torch.float32
    cpu_reason = selector.unsupported_reason("cpu", cpu, fp32, 12)
    assert cpu_reason == "the cpu attention backend needs a head_dim divisible by 8 (got 12)"
    reason = unsupported_reason(cpu, fp32, None, False, cpu_reason)
    assert reason.endswith(f"cannot serve: {cpu_reason}") and "choose --attention-backend cpu" not in reason
    assert "choose --attention-backend cpu" in unsupported_reason(cpu, fp32, None, False, None)
