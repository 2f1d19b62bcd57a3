"""The sampler on crafted logits: exact masks, penalties by hand, seeded reproducibility; the
sampler-level cases both the torch way and with the CPU kernels' one pass for plain rows."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from pagoda.kernels import cpu as cpu_kernels
from pagoda.model_executor.sampler import Sampler, apply_penalties, draw, filtered_probs
from pagoda.request import Request
from pagoda.sampling_params import SamplingParams, SamplingParamsError

_ids = itertools.count()


def req(prompt=(1, 2), outputs=(), **params) -> Request:
    r = Request(f"r{next(_ids)}", list(prompt), SamplingParams(**params), frozenset({0}), 100)
    for t in outputs:
        r.append_token(t)
    return r


@pytest.fixture(params=["torch", "kernels"])
def new_sampler(request):
    """Sampler's constructor, without kernels or with this CPU's"""
    if request.param == "torch":
        return Sampler
    kernels = cpu_kernels.load()
    if kernels is None:
        pytest.skip("the C kernels cannot be built on this machine")
    return lambda: Sampler(kernels)


LOGITS = torch.log(torch.tensor([[0.05, 0.4, 0.3, 0.15, 0.1]]))


def support(probs: torch.Tensor) -> set[int]:
    return set(torch.nonzero(probs[0] > 0).flatten().tolist())


def test_draw_inverts_the_cumulative_distribution():
    """u in [0, 1) picks the first token whose cumulative weight exceeds u * total: the cut points
    exactly, zero-weight tokens never (not even at u = 0 or the largest u below 1), any total."""
    weights = torch.tensor([[0.0, 0.25, 0.0, 0.5, 0.25, 0.0]] * 2) * torch.tensor([[1.0], [3.0]])
    below_one = 1.0 - 2.0**-53
    cases = {0.0: 1, 0.2499: 1, 0.25: 3, 0.7499: 3, 0.75: 4, below_one: 4}
    for u, token in cases.items():
        assert draw(weights, torch.tensor([u, u], dtype=torch.float64)).tolist() == [token, token], u


def test_draw_on_rows_without_a_distribution_stays_in_the_vocabulary():
    """NaN, infinite or all-zero weights (a repetition penalty of 1e-308 makes them) give the row's
    argmax, never an index past the vocabulary; a sound row beside them is drawn as usual."""
    nan, inf = float("nan"), float("inf")
    weights = torch.tensor([[0.1, nan, 0.2], [0.0, inf, inf], [0.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    tokens = draw(weights, torch.full((4,), 0.5, dtype=torch.float64))
    assert tokens.tolist() == [1, 1, 0, 2]


def test_draw_follows_the_distribution():
    """Many draws' frequencies match p within 5 standard errors (a fixed generator)."""
    p = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    n = 200_000
    uniforms = torch.rand(n, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    counts = torch.bincount(draw(p.expand(n, -1), uniforms), minlength=5).double() / n
    assert counts[4] == 0
    assert torch.all((counts[:4] - p[:4]).abs() <= 5 * torch.sqrt(p[:4] * (1 - p[:4]) / n)), counts


def test_top_k_keeps_exactly_k():
    probs = filtered_probs(LOGITS, [SamplingParams(top_k=2)])
    assert support(probs) == {1, 2}
    assert torch.allclose(probs[0, [1, 2]], torch.tensor([0.4, 0.3]) / 0.7)


def test_top_p_keeps_the_smallest_set_reaching_p():
    # sorted: 0.4, 0.3, 0.15, 0.1, 0.05; 0.4 + 0.3 = 0.7 < 0.75, so 0.15 joins
    assert support(filtered_probs(LOGITS, [SamplingParams(top_p=0.75)])) == {1, 2, 3}
    assert support(filtered_probs(LOGITS, [SamplingParams(top_p=0.7)])) == {1, 2}
    assert support(filtered_probs(LOGITS, [SamplingParams(top_p=0.01)])) == {1}  # the top token always stays


def test_min_p_relative_to_the_top_probability():
    # threshold 0.5 * 0.4 = 0.2
    probs = filtered_probs(LOGITS, [SamplingParams(min_p=0.5)])
    assert support(probs) == {1, 2}
    assert math.isclose(float(probs.sum()), 1.0, rel_tol=1e-6)


def test_temperature_sharpens():
    cold = filtered_probs(LOGITS, [SamplingParams(temperature=0.5)])
    expected = torch.tensor([0.05, 0.4, 0.3, 0.15, 0.1]) ** 2
    assert torch.allclose(cold[0], expected / expected.sum(), atol=1e-6)


def test_penalties_against_hand_computation():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    r = req(prompt=(0,), outputs=(1, 3, 3), repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    apply_penalties(logits, [r])
    # seen (prompt+output) = {0, 1, 3}: positive / 2, negative * 2; then output counts {1: 1, 3: 2}
    expected = [2.0 / 2, -1.0 * 2 - 0.25 * 1 - 0.5, 0.5, 3.0 / 2 - 0.25 * 2 - 0.5, -2.0]
    assert torch.allclose(logits[0], torch.tensor(expected))


def test_logit_bias_and_min_tokens(new_sampler):
    logits = torch.zeros(1, 5)
    logits[0, 0] = 10.0  # eos is the clear favourite
    out = new_sampler().sample(logits.clone(), [req(temperature=0.0, logit_bias={4: 20.0})])
    assert out.token_ids == [4]
    out = new_sampler().sample(logits.clone(), [req(temperature=0.0, min_tokens=2)])
    assert out.token_ids != [0]  # eos banned before min_tokens outputs
    out = new_sampler().sample(logits.clone(), [req(outputs=(3, 3), temperature=0.0, min_tokens=2)])
    assert out.token_ids == [0]


def test_seeded_rows_do_not_depend_on_the_batch(new_sampler):
    torch.manual_seed(0)
    logits = torch.randn(4, 50)

    def draws(batch_extra: list[Request]) -> list[int]:
        seeded, sampler = req(temperature=1.0, seed=7), new_sampler()
        rows = logits[: 1 + len(batch_extra)]
        return [sampler.sample(rows.clone(), [seeded] + batch_extra).token_ids[0] for _ in range(20)]

    alone = draws([])
    crowded = draws([req(temperature=1.0), req(temperature=1.0, seed=99), req(temperature=0.0)])
    assert alone == crowded
    filtered = draws([req(temperature=1.0, top_k=5), req(temperature=0.7, top_p=0.9), req(temperature=1.0, min_p=0.2)])
    assert alone == filtered
    assert len(set(alone)) > 1  # it is really sampling


def test_a_rows_filtered_probabilities_do_not_depend_on_the_other_rows():
    """Each filter touches only the rows asking for it: a plain row beside top-k, top-p and min-p
    rows has bitwise its probabilities alone (a top-p of 1 applied to it anyway used to cut a
    tail of the 49,152-token vocabulary where float32's running sum reached 1 early)."""
    logits = torch.randn(4, 49152, generator=torch.Generator().manual_seed(3)) * 3
    plain = SamplingParams(temperature=1.0)
    alone = filtered_probs(logits[:1].clone(), [plain])
    others = [SamplingParams(temperature=1.0, top_k=40), SamplingParams(top_p=0.95), SamplingParams(min_p=0.05)]
    for other in others:
        beside = filtered_probs(torch.stack([logits[0], logits[1]]), [plain, other])
        assert torch.equal(beside[0], alone[0]), other
    for other in others:  # and each filtered row is the same alone as beside the others
        batch = filtered_probs(logits.clone(), [plain, *others])
        i = others.index(other) + 1
        assert torch.equal(batch[i], filtered_probs(logits[i : i + 1].clone(), [other])[0]), other


def test_sampling_follows_the_distribution(new_sampler):
    torch.manual_seed(0)
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]])).repeat(4000, 1)
    tokens = new_sampler().sample(logits, [req(temperature=1.0)] * 4000).token_ids
    freq = [tokens.count(i) / 4000 for i in range(3)]
    assert freq == pytest.approx([0.7, 0.2, 0.1], abs=0.03)


def test_logprobs_of_raw_logits_with_rank(new_sampler):
    logits = torch.log(torch.tensor([[0.1, 0.6, 0.3]]))
    out = new_sampler().sample(logits.clone(), [req(temperature=0.0, logprobs=2)])
    lp = out.logprobs[0]
    assert lp.token_id == 1 and lp.rank == 1 and lp.logprob == pytest.approx(math.log(0.6), abs=1e-6)
    assert set(lp.top) == {1, 2} and lp.top[2] == pytest.approx(math.log(0.3), abs=1e-6)


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", -1),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("min_p", 2.0),
        ("max_tokens", 0),
        ("n", 0),
        ("presence_penalty", 3.0),
        ("logprobs", 21),
        ("thinking_token_budget", 8),  # no `reasoning`: nothing says where the thinking is
        ("thinking_token_budget", 1.5),
        ("thinking_token_budget", True),
    ],
)
def test_invalid_params_name_the_field(field, value):
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(**{field: value})
    assert info.value.param == field


def test_a_seeded_generator_lives_until_the_request_is_dropped(new_sampler):
    logits = torch.zeros(1, 1000)
    seeded, sampler = req(temperature=1.0, seed=3), new_sampler()
    first = [sampler.sample(logits.clone(), [seeded]).token_ids[0] for _ in range(5)]
    fresh = new_sampler()
    assert [fresh.sample(logits.clone(), [seeded]).token_ids[0] for _ in range(5)] == first
    sampler.drop([seeded.request_id])  # finished: the next request of that id starts from its seed again
    assert sampler.sample(logits.clone(), [seeded]).token_ids[0] == first[0]
    assert len(set(first)) > 1


def test_the_kernels_take_plain_rows_and_leave_the_rest_to_torch():
    """With the kernels, the plain greedy and plain random rows of a batch are one pass: the greedy
    rows are torch's argmax and the seeded random row draws from its own generator as the torch way
    does; a row with a filter (top-k) is sampled the torch way, whatever the others are, and a batch
    whose plain rows hold a NaN is sampled the torch way whole, so its tokens equal the kernel-less
    sampler's with the same generators."""
    kernels = cpu_kernels.load()
    if kernels is None:
        pytest.skip("the C kernels cannot be built on this machine")
    logits = torch.randn(3, 1000, generator=torch.Generator().manual_seed(0)) * 4
    batches = {
        "plain": [req(temperature=0.0), req(temperature=1.0, seed=5), req(temperature=0.0)],
        "top-k": [req(temperature=0.0), req(temperature=1.0, seed=5), req(temperature=0.8, top_k=3, seed=6)],
    }
    for name, batch in batches.items():
        with_kernels = Sampler(kernels).sample(logits.clone(), batch).token_ids
        torch_way = Sampler().sample(logits.clone(), batch).token_ids
        assert with_kernels[0] == torch_way[0] == int(logits[0].argmax()), name
        assert with_kernels[1:] == torch_way[1:], name  # the same uniforms; this draw is no near-tie
    nan_row = logits.clone()
    nan_row[0, 7] = float("nan")
    batch = [req(temperature=0.0), req(temperature=1.0, seed=5), req(temperature=0.0)]
    assert Sampler(kernels).sample(nan_row.clone(), batch).token_ids[0] == 7  # torch's argmax takes the NaN
