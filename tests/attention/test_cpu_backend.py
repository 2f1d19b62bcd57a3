"""The cpu backend (C decode kernel reading the paged cache in place) against the torch reference,
on the widest instruction set here and on the AVX2 floor."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pagoda.attention.cpu_backend import CpuAttentionBackend
from pagoda.kernels import cpu as cpu_kernels

from . import helpers
from .helpers import Step, make_step
from .test_triton_backend import SCENARIOS

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="the C kernels cannot be built on this machine")


@pytest.fixture(params=["native", "avx2"])
def isa(request, monkeypatch):
    """The kernels rebuilt (or loaded from the cache) for this ISA level, and again after the test."""
    if request.param == "avx2":
        monkeypatch.setenv("PAGODA_CPU_ISA", "avx2")
    cpu_kernels._load.cache_clear()
    lib = cpu_kernels.load()
    assert lib is not None and (request.param == "native" or lib.isa[-1] == "avx2")
    yield request.param
    cpu_kernels._load.cache_clear()


@pytest.fixture
def num_threads(request):
    """Threads the kernel shares its spans out to (the spans themselves do not depend on it)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def assert_matches_reference(step: Step, tol: float = 1e-5):
    helpers.assert_matches_reference(CpuAttentionBackend(), step, tol)


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("block_size,group", [(16, 1), (16, 3), (8, 4), (1, 2)])
def test_matches_reference(isa, scenario, block_size, group):
    query_lens, seq_lens = SCENARIOS[scenario]
    assert_matches_reference(make_step(query_lens, seq_lens, block_size=block_size, group=group))


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("block_size,group", [(16, 3), (1, 2)])
def test_batch_invariant_matches_reference(isa, scenario, block_size, group):
    """Deterministic serving's prefills (the decode kernel's arithmetic per row) against SDPA."""
    step = make_step(*SCENARIOS[scenario], block_size=block_size, group=group)
    helpers.assert_matches_reference(CpuAttentionBackend(batch_invariant=True), step, 1e-5)


@pytest.mark.parametrize("head_dim", [8, 72, 128])
def test_other_head_dims(head_dim):
    assert_matches_reference(make_step(*SCENARIOS["decode"], head_dim=head_dim, group=2))


def test_long_contexts_and_many_requests(isa):
    """Contexts past the prefetch distance and across many blocks; more requests than threads."""
    lens = [1, 2, 15, 16, 17, 300, 1000, 2049]
    assert_matches_reference(make_step([1] * len(lens), lens, num_kv_heads=3, group=3))


@pytest.mark.parametrize("num_threads", [1, 2, 5], indirect=True)
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("seq_len", [129, 1000, 4000])
def test_batch_one_long_context(isa, num_threads, block_size, seq_len):
    """One request split into token spans, merged afterwards (SmolLM2's 9 heads, 3 kv heads)."""
    assert_matches_reference(make_step([1], [seq_len], block_size=block_size, num_kv_heads=3, group=3))


@pytest.mark.parametrize("num_threads", [1], indirect=True)
@pytest.mark.parametrize("seq_lens", [[256], [257], [512], [513], [519], [1, 128, 257, 1500]])
def test_span_boundaries(isa, num_threads, seq_lens):
    """Spans of 256 tokens: 256 and 512 end on a span boundary, 257 and 513 leave a last span of
    one token; a batch mixes one-span and split requests."""
    step = make_step([1] * len(seq_lens), seq_lens, num_kv_heads=1, group=2, seed=len(seq_lens))
    assert_matches_reference(step)


def only_request(step: Step, i: int) -> Step:
    """Decode request i of a step of decodes, alone, over the same cache."""
    x = step.inputs
    inputs = dataclasses.replace(
        x,
        query_start_loc=torch.tensor([0, 1], dtype=x.query_start_loc.dtype),
        seq_lens=x.seq_lens[i : i + 1],
        block_tables=x.block_tables[i : i + 1],
        slot_mapping=x.slot_mapping[i : i + 1],
        num_decodes=1,
        query_lens_cpu=(1,),
        seq_lens_cpu=(x.seq_lens_cpu[i],),
    )
    rows = slice(i, i + 1)
    return dataclasses.replace(step, inputs=inputs, query=step.query[rows], key=step.key[rows], value=step.value[rows])


def test_a_request_gets_the_same_bits_whatever_else_runs_and_however_many_threads():
    """Spans depend on a request's own length only: alone or beside others, on 1 or 2 threads, its
    output is bitwise the same."""
    lens = [700, 5, 3000, 256]
    together = make_step([1] * len(lens), lens, num_kv_heads=3, group=3, seed=7)
    results = []
    for threads in (1, 2):
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            results.append(helpers.run(CpuAttentionBackend(), together)[0])
            for i, n in enumerate(lens):
                alone_out = helpers.run(CpuAttentionBackend(), only_request(together, i))[0]
                assert torch.equal(alone_out[0], results[-1][i]), (threads, n)
        finally:
            torch.set_num_threads(before)
    assert torch.equal(results[0], results[1])


@pytest.mark.parametrize("head_dim", [72, 128])
def test_many_heads_and_groups(isa, head_dim):
    """32 query heads over 8 kv heads; head_dim 72 ends in a half vector of AVX-512."""
    step = make_step([1, 1, 1], [1, 300, 3000], num_kv_heads=8, group=4, head_dim=head_dim)
    assert_matches_reference(step)


def test_peaked_softmax(isa):
    """Scores thousands apart: the exponentials of the losers underflow, the winner's weight is 1.

    Each kv head's winner (a random cached or new token) gets a key along its group's shared query,
    so no two scores are near a tie. Near ties at this scale would make any float32 answer uncertain
    by more than the tolerance (a score of 300 is rounded to 3e-5, and a tie's output moves by its
    score error times |v1 - v2| / 4), so the test would compare the implementations' rounding rather
    than their softmax; against a float64 softmax this one is exact to float32 precision.
    """
    step = dataclasses.replace(make_step(*SCENARIOS["decode"], group=3, seed=3), scale=40.0)
    gen = torch.Generator().manual_seed(4)
    inputs, cache = step.inputs, step.kv_cache
    num_kv_heads, group, head_dim = step.key.shape[1], 3, step.key.shape[2]
    direction = torch.randn(len(inputs.seq_lens_cpu), num_kv_heads, head_dim, generator=gen)
    step.query.copy_(direction.repeat_interleave(group, dim=1))
    for b, seq_len in enumerate(inputs.seq_lens_cpu):
        for h in range(num_kv_heads):
            winner = int(torch.randint(seq_len, (1,), generator=gen))
            key = 2 * direction[b, h]  # score 80 |d|^2, ~5,000; the others ~40 |d| |k| |cos| < 2,000
            if winner == seq_len - 1:
                step.key[b, h] = key
            else:
                block = inputs.block_tables[b, winner // inputs.block_size]
                cache[0, block, winner % inputs.block_size, h] = key
    out, cache_after = helpers.run(CpuAttentionBackend(), step)
    assert torch.equal(cache_after, helpers.reference(step)[1])
    torch.testing.assert_close(out, float64_decodes(step, cache_after).float(), atol=1e-5, rtol=1e-5)


def float64_decodes(step: Step, cache: torch.Tensor) -> torch.Tensor:
    """Decode attention of every request in float64 from the float32 cache after the step."""
    inputs, outs = step.inputs, []
    for b, seq_len in enumerate(inputs.seq_lens_cpu):
        blocks = inputs.block_tables[b, : -(-seq_len // inputs.block_size)].long()
        k, v = (cache[i, blocks].flatten(0, 1)[:seq_len].double() for i in (0, 1))
        group = step.query.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,thd->ht", step.query[b].double(), k) * step.scale
        outs.append(torch.einsum("ht,thd->hd", scores.softmax(dim=1), v))
    return torch.stack(outs)


def test_strided_query_key_value():
    """Queries, keys and values are views of the fused qkv projection."""
    step = make_step(*SCENARIOS["mixed"], group=2)
    qkv = torch.cat([step.query, step.key, step.value], dim=1)
    heads, kv_heads = step.query.shape[1], step.key.shape[1]
    views = qkv[:, :heads], qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]
    assert not any(view.is_contiguous() for view in views)
    assert_matches_reference(dataclasses.replace(step, query=views[0], key=views[1], value=views[2]))


def test_store_kv_skips_negative_slots():
    key, value = torch.randn(4, 2, 8), torch.randn(4, 2, 8)
    cache = torch.zeros(2, 3, 4, 2, 8)
    cpu_kernels.store_kv(CpuAttentionBackend().lib, key, value, cache, torch.tensor([5, -1, 0, 11]))
    expected = torch.zeros_like(cache)
    for token, slot in ((0, 5), (2, 0), (3, 11)):
        expected[0, slot // 4, slot % 4] = key[token]
        expected[1, slot // 4, slot % 4] = value[token]
    assert torch.equal(cache, expected)


def as_float32(step: Step) -> Step:
    inputs = dataclasses.replace(step.inputs, dtype=torch.float32)
    tensors = {f: getattr(step, f).float() for f in ("query", "key", "value", "kv_cache")}
    return dataclasses.replace(step, inputs=inputs, **tensors)


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("block_size,group", [(16, 3), (1, 2)])
def test_bfloat16_matches_float32_math(scenario, block_size, group):
    """A bf16 cache and query: decodes are the float32 kernel's results on the same values, rounded
    to bf16 (bitwise), near the float32 reference; prefill chunks within bf16 SDPA's error; the
    cache gets this step's bf16 keys and values bit for bit."""
    step = make_step(*SCENARIOS[scenario], block_size=block_size, group=group, dtype=torch.bfloat16)
    out, cache = helpers.run(CpuAttentionBackend(), step)
    ref_out, ref_cache = helpers.reference(as_float32(step))
    assert out.dtype == torch.bfloat16 and cache.dtype == torch.bfloat16
    assert torch.equal(cache.float(), ref_cache)
    nd = step.inputs.num_decodes
    float32_kernel, _ = helpers.run(CpuAttentionBackend(), as_float32(step))
    assert torch.equal(out[:nd], float32_kernel[:nd].bfloat16())
    torch.testing.assert_close(out[:nd].float(), ref_out[:nd], atol=1e-3, rtol=2**-7)
    torch.testing.assert_close(out[nd:].float(), ref_out[nd:], atol=2e-2, rtol=2e-2)


def bf16_kv(step: Step) -> Step:
    """The step on a bfloat16 cache (a float32 model with --kv-cache-dtype bfloat16)."""
    return dataclasses.replace(step, kv_cache=step.kv_cache.bfloat16())


def rounded_kv(step: Step) -> Step:
    """The step on a float32 cache that holds bf16-rounded values, its new keys and values rounded too:
    what a bfloat16 cache must compute exactly."""

    def rounded(x):
        return x.bfloat16().float()

    return dataclasses.replace(step, key=rounded(step.key), value=rounded(step.value), kv_cache=rounded(step.kv_cache))


@pytest.mark.parametrize("scenario", [*SCENARIOS, "long"])
@pytest.mark.parametrize("block_size,group", [(16, 3), (1, 2)])
def test_bfloat16_cache_is_the_float32_arithmetic_on_rounded_values(isa, scenario, block_size, group):
    """A float32 model's bf16 KV cache: new keys and values stored rounded to the nearest bf16 (as
    torch rounds), and every output bitwise the float32 cache's on the rounded values, decodes and
    prefill chunks, within a span and across span boundaries (long: 600 and 300 tokens)."""
    lens = ([1, 40], [600, 300]) if scenario == "long" else SCENARIOS[scenario]
    step = make_step(*lens, block_size=block_size, group=group, seed=3)
    out, cache = helpers.run(CpuAttentionBackend(), bf16_kv(step))
    ref_out, ref_cache = helpers.run(CpuAttentionBackend(), rounded_kv(step))
    assert cache.dtype == torch.bfloat16 and out.dtype == torch.float32
    assert torch.equal(cache.float(), ref_cache)
    assert torch.equal(out, ref_out)


@pytest.mark.parametrize("head_dim", [8, 72])
def test_bfloat16_store_rounds_as_torch(isa, head_dim):
    """Stores into a bf16 cache round as torch's .bfloat16() does: to nearest, ties to even, a NaN
    stays NaN, infinities and overflow to infinity as they are; a token's row of 8 or 72 floats
    (whole vectors, then the rest one by one)."""
    gen = torch.Generator().manual_seed(head_dim)
    key = torch.randn(4, 1, head_dim, generator=gen)
    special = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), float("inf"), float("nan"), 3.4e38, 1e-40, -0.0])
    key.view(-1)[-8:] = special  # ties both ways, signs, NaN, overflow, a subnormal: the tail lanes
    value = -key
    cache = torch.zeros(2, 1, 4, 1, head_dim, dtype=torch.bfloat16)
    cpu_kernels.store_kv(cpu_kernels.load(), key, value, cache, torch.arange(4))
    for stored, source in ((cache[0], key), (cache[1], value)):
        expected = source.bfloat16().view(torch.int16)
        got = stored.reshape(4, 1, head_dim).view(torch.int16)
        nan = source.isnan()
        assert torch.equal(got[~nan], expected[~nan]) and stored.reshape(4, 1, head_dim)[nan].isnan().all()
