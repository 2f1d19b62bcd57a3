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
    cpu_kernels.load.cache_clear()
    lib = cpu_kernels.load()
    assert lib is not None and (request.param == "native" or lib.isa[-1] == "avx2")
    yield request.param
    cpu_kernels.load.cache_clear()


@pytest.fixture
def num_threads(request):
    """Threads the kernel splits its work over: the split into spans depends on it."""
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
@pytest.mark.parametrize("seq_lens", [[1024], [1025], [2048], [2049], [2055], [1, 128, 129, 1500]])
def test_span_boundaries(isa, num_threads, seq_lens):
    """One thread: spans of max(128, tokens / 8) tokens, so 1024 and 2048 end on a span boundary and
    1025, 2049 leave a last span of one token; a batch mixes one-span and split requests."""
    step = make_step([1] * len(seq_lens), seq_lens, num_kv_heads=1, group=2, seed=len(seq_lens))
    assert_matches_reference(step)


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
