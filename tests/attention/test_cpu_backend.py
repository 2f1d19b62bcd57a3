"""The cpu backend (C decode kernel reading the paged cache in place) against the torch reference."""

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


def assert_matches_reference(step: Step, tol: float = 1e-5):
    helpers.assert_matches_reference(CpuAttentionBackend(), step, tol)


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("block_size,group", [(16, 1), (16, 3), (8, 4), (1, 2)])
def test_matches_reference(scenario, block_size, group):
    query_lens, seq_lens = SCENARIOS[scenario]
    assert_matches_reference(make_step(query_lens, seq_lens, block_size=block_size, group=group))


@pytest.mark.parametrize("head_dim", [8, 72, 128])
def test_other_head_dims(head_dim):
    assert_matches_reference(make_step(*SCENARIOS["decode"], head_dim=head_dim, group=2))


def test_long_contexts_and_many_requests():
    """Contexts past the prefetch distance and across many blocks; more requests than threads."""
    lens = [1, 2, 15, 16, 17, 300, 1000, 2049]
    assert_matches_reference(make_step([1] * len(lens), lens, num_kv_heads=3, group=3))


def test_peaked_softmax():
    """Scores hundreds apart: the exponentials of the losers underflow, the winner's weight is 1."""
    step = make_step(*SCENARIOS["decode"], group=2, seed=3)
    assert_matches_reference(dataclasses.replace(step, scale=40.0))


def test_strided_query():
    """Queries are views of the fused qkv projection."""
    step = make_step(*SCENARIOS["mixed"], group=2)
    qkv = torch.cat([step.query, step.key, step.value], dim=1)
    query = qkv[:, : step.query.shape[1]]
    assert not query.is_contiguous()
    assert_matches_reference(dataclasses.replace(step, query=query))


def as_float32(step: Step) -> Step:
    inputs = dataclasses.replace(step.inputs, dtype=torch.float32)
    tensors = {f: getattr(step, f).float() for f in ("query", "key", "value", "kv_cache")}
    return dataclasses.replace(step, inputs=inputs, **tensors)


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("block_size,group", [(16, 3), (1, 2)])
def test_bfloat16_matches_float32_math(scenario, block_size, group):
    """A bf16 cache and query: the result is the float32 reference on the same values, rounded to
    bf16 (decodes, computed in fp32) or within bf16 SDPA's error (prefill chunks); the cache gets
    this step's bf16 keys and values bit for bit."""
    step = make_step(*SCENARIOS[scenario], block_size=block_size, group=group, dtype=torch.bfloat16)
    out, cache = helpers.run(CpuAttentionBackend(), step)
    ref_out, ref_cache = helpers.reference(as_float32(step))
    assert out.dtype == torch.bfloat16 and cache.dtype == torch.bfloat16
    assert torch.equal(cache.float(), ref_cache)
    nd = step.inputs.num_decodes
    torch.testing.assert_close(out[:nd].float(), ref_out[:nd], atol=1e-3, rtol=2**-7)
    torch.testing.assert_close(out[nd:].float(), ref_out[nd:], atol=2e-2, rtol=2e-2)
