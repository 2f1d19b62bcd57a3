"""The sampling kernel (csrc/sample.c) against the sampler's torch rules it replaces for plain rows:
greedy is torch's argmax (first index of the largest, any infinity), a random row is sampler.draw
on softmax(logits / T) with the same uniform, a masked (-inf) token is never drawn, and the rows it
cannot decide (a NaN, no finite positive total) come back -1; built for this CPU and capped at AVX2,
float32 and bfloat16 logits, vocabularies with and without a part vector."""

from __future__ import annotations

import pytest
import torch

from pagoda.kernels import cpu as cpu_kernels
from pagoda.model_executor.sampler import draw, filtered_probs
from pagoda.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="the C kernels cannot be built on this machine")

DTYPES = [torch.float32, torch.bfloat16]
INF, NAN = float("inf"), float("nan")


def greedy(lib, logits: torch.Tensor) -> torch.Tensor:
    rows = logits.shape[0]
    return cpu_kernels.sample_rows(lib, logits, torch.zeros(rows), torch.zeros(rows, dtype=torch.float64))


def drawn(lib, logits: torch.Tensor, temperature: float, uniforms: torch.Tensor) -> torch.Tensor:
    return cpu_kernels.sample_rows(lib, logits, torch.full((logits.shape[0],), temperature), uniforms)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [5, 16, 49152, 1003])
def test_greedy_is_torch_argmax(lib, dtype, vocab):
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(vocab)).to(dtype)
    logits[1, vocab // 3] = logits[1, -1] = 50.0  # a tie: the first index
    logits[2] = -INF  # all masked: index 0, as torch
    logits[3, -1] = INF
    logits[4, :] = logits[4, 0]  # all equal
    assert torch.equal(greedy(lib, logits), logits.argmax(dim=-1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_it_cannot_decide_come_back_minus_one(lib, dtype):
    logits = torch.tensor([[1.0, NAN, 3.0], [-INF, -INF, -INF], [1.0, INF, 0.0], [1.0, 2.0, 3.0]]).to(dtype)
    tokens = drawn(lib, logits, 1.0, torch.full((4,), 0.5, dtype=torch.float64))
    assert tokens.tolist() == [-1, -1, -1, 2]  # NaN, no total, an infinite weight; a sound row drawn
    assert greedy(lib, logits).tolist() == [-1, 0, 1, 2]  # greedy: only the NaN row is left to torch


@pytest.mark.parametrize("dtype", DTYPES)
def test_draw_cuts_where_the_cumulative_weight_exceeds_u_times_total(lib, dtype):
    """Weights 0, 1/4, 0, 1/2, 1/4 (logits log w, -inf for 0): u picks the first token whose
    cumulative weight exceeds u * total, masked tokens never (not at u = 0 nor just below 1)."""
    logits = torch.log(torch.tensor([[0.0, 0.25, 0.0, 0.5, 0.25, 0.0]])).to(dtype).repeat(2, 1)
    below_one = 1.0 - 2.0**-53
    for u, token in {0.0: 1, 0.2: 1, 0.3: 3, 0.7: 3, 0.8: 4, below_one: 4}.items():
        assert drawn(lib, logits, 1.0, torch.tensor([u, u], dtype=torch.float64)).tolist() == [token, token], u


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
def test_draws_match_the_torch_rule(lib, dtype, temperature):
    """The same uniforms give sampler.draw's tokens on softmax(logits / T) across a 49,152-token
    vocabulary, but where the two sums' float rounding differs at a cut (measured: 1 draw in 7,680,
    an adjacent token)."""
    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn(64, 49152, generator=generator) * 3).to(dtype)
    logits[0, :1000] = -INF
    uniforms = torch.rand(64 * 4, dtype=torch.float64, generator=generator)
    agree = 0
    for u in uniforms.view(4, 64):
        tokens = drawn(lib, logits, temperature, u)
        reference = draw(filtered_probs(logits.float(), [SamplingParams(temperature=temperature)] * 64), u)
        assert bool((tokens[0] >= 1000) & (tokens >= 0).all())
        assert bool(((tokens - reference).abs() <= 1).all())
        agree += int((tokens == reference).sum())
    assert agree >= 254, agree


def test_draws_follow_the_distribution(lib):
    """Frequencies within 5 standard errors of p (a fixed generator)."""
    p = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    n = 100_000
    uniforms = torch.rand(n, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    tokens = drawn(lib, torch.log(p).expand(n, -1).contiguous(), 1.0, uniforms)
    counts = torch.bincount(tokens, minlength=5).double() / n
    assert counts[4] == 0
    assert torch.all((counts[:4] - p[:4]).abs() <= 5 * torch.sqrt(p[:4] * (1 - p[:4]) / n)), counts
