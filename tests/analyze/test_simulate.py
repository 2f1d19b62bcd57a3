"""Exact predictions of the cache simulator on hand-built request sequences, and agreement with a
slow reference simulator on random ones."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagoda.analyze.simulate import CacheSimulator, ReplayRequest, Simulation

from .reference_cache import reference_reuse


def simulate(prompts: list[list[int]], block_size: int, outputs: list[list[int] | None] | None = None) -> Simulation:
    simulator = CacheSimulator(block_size)
    for i, prompt in enumerate(prompts):
        output = None if outputs is None or outputs[i] is None else np.array(outputs[i], dtype=np.int32)
        simulator.add(ReplayRequest(i + 1, np.array(prompt, dtype=np.int32), output))
        simulator.check_integrity()
    return simulator.finish()


def seq(start: int, stop: int) -> list[int]:
    return list(range(start, stop))


def test_shared_prefix_block_boundaries_and_one_token_rule():
    sim = simulate(
        [
            seq(1, 9),  # 8 tokens: nothing cached yet
            seq(1, 9),  # the same 8: both blocks match, but one token must be computed -> 1 block
            seq(1, 10),  # 9 tokens: both cached blocks usable
            seq(1, 8) + [99],  # diverges at token 8: 7 tokens match, 1 whole block
            [1, 2, 3],  # 3 tokens, all cached: no whole block; token granularity keeps one to compute
            [50, 51, 52, 53, 54],  # nothing shared
        ],
        block_size=4,
    )
    assert sim.reusable("block").tolist() == [0, 4, 8, 4, 0, 0]
    assert sim.reusable("token").tolist() == [0, 7, 8, 7, 2, 0]
    assert sim.matched_tokens.tolist() == [0, 8, 8, 7, 3, 0]


def test_block_size_16_counts_only_whole_blocks():
    system = seq(1000, 1040)  # 40 tokens: two whole blocks and 8 more
    sim = simulate([system + [1, 2], system + [3, 4], system[:32] + [5]], block_size=16)
    assert sim.reusable("block").tolist() == [0, 32, 32]
    assert sim.reusable("token").tolist() == [0, 40, 32]


def test_output_tokens_but_the_last_are_cached_for_the_next_turn():
    first, answer = seq(1, 7), [7, 8, 9]  # the KV of 9, the last sampled token, is never computed
    second = first + answer + [10]
    with_outputs = simulate([first, second], block_size=4, outputs=[answer, None])
    assert with_outputs.reusable("token").tolist() == [0, 8]
    assert with_outputs.reusable("block").tolist() == [0, 8]
    prompts_only = simulate([first, second], block_size=4)
    assert prompts_only.reusable("token").tolist() == [0, 6]
    assert prompts_only.reusable("block").tolist() == [0, 4]


def test_lru_evicts_least_recently_used_not_first_inserted():
    a, b, c = seq(100, 109), seq(200, 209), seq(300, 309)  # 9 tokens: 2 whole blocks each
    sim = simulate([a, b, a, c, a, b], block_size=4)
    # Room for 4 blocks: c evicts b (a was used again after b), so a hits and b misses.
    assert sim.reusable("block", cache_tokens=16).tolist() == [0, 0, 8, 0, 8, 0]
    assert sim.reusable("block", cache_tokens=None).tolist() == [0, 0, 8, 0, 8, 8]
    # Token granularity with room for 24 tokens: after c, a's 9 and c's 9 stay, and 6 of b's.
    assert sim.reusable("token", cache_tokens=24).tolist() == [0, 0, 8, 0, 8, 6]


def test_eviction_trims_a_branch_from_its_tail():
    a, b = seq(100, 113), seq(200, 213)  # 13 tokens: 3 whole blocks each
    sim = simulate([a, b, a], block_size=4)
    # 5 blocks fit: b's 3 and a's first 2 (a's deepest block goes first), so a reuses 2 blocks.
    assert sim.reusable("block", cache_tokens=20).tolist() == [0, 0, 8]
    assert sim.reusable("block", cache_tokens=16).tolist() == [0, 0, 4]
    assert sim.reusable("block", cache_tokens=12).tolist() == [0, 0, 0]
    assert sim.reusable("token", cache_tokens=13 + 5).tolist() == [0, 0, 5]


def test_a_shared_prefix_stays_while_its_branches_are_evicted():
    system = seq(1, 9)  # 2 blocks, used by every request
    prompts = [system + seq(100 * i, 100 * i + 5) for i in range(1, 6)]  # 3 whole blocks each
    sim = simulate(prompts, block_size=4)
    # Room for 3 blocks: the shared 2 and the latest request's own block.
    assert sim.reusable("block", cache_tokens=12).tolist() == [0, 8, 8, 8, 8]
    assert sim.reusable("block", cache_tokens=4).tolist() == [0, 4, 4, 4, 4]


def test_requests_reuse_only_what_their_own_cache_salt_left():
    """A salt is a cache namespace of its own (the server's rule), in one LRU pool for all."""
    system = seq(1, 13)  # 3 whole blocks of 4, and each request's own last token
    simulator = CacheSimulator(4)
    for i, salt in enumerate(["a", "b", None, "a", None, "b"]):
        simulator.add(ReplayRequest(i + 1, np.array(system + [100 + i], dtype=np.int32), cache_salt=salt))
        simulator.check_integrity()
    sim = simulator.finish()
    assert sim.reusable("block").tolist() == [0, 0, 0, 12, 12, 12]
    # room for 6 blocks: the third salt's copy evicts a's, a's new one b's; None's stays
    assert sim.reusable("block", cache_tokens=24).tolist() == [0, 0, 0, 0, 12, 0]
    assert sim.distinct_tokens == 3 * 13 + 3


def test_shared_prefixes_rank_by_tokens_the_later_requests_reuse():
    system, preamble = seq(1, 41), seq(1, 11)
    sim = simulate([system + [500], system + [501], system + [502], preamble + [600], preamble + [601]], block_size=4)
    prefixes = [(prefix.tokens.tolist(), prefix.requests) for prefix in sim.shared_prefixes]
    assert prefixes == [(system, 3), (preamble, 5)]


def test_shared_prefixes_count_prompts_not_outputs_written_again():
    """Requests with one prompt whose (greedy) outputs agree share the prompt, not the outputs: a later
    one reads only its prompt from a cache; a next turn whose prompt holds an output shares that too."""
    prompt, answer = seq(1, 17), [90, 91, 92, 93]
    sim = simulate([prompt] * 3 + [prompt + answer[:3] + [7, 8]], block_size=4, outputs=[answer] * 3 + [None])
    assert [(len(p.tokens), p.requests) for p in sim.shared_prefixes] == [(16, 4), (19, 2)]


def test_shared_prefixes_shorter_than_a_block_are_left_out():
    sim = simulate([[1, 2, 3, 4], [1, 2, 3, 5]], block_size=4)
    assert sim.shared_prefixes == ()


# ---- against the reference simulator -------------------------------------------------------

token_lists = st.lists(st.integers(0, 3), min_size=1, max_size=30)


@st.composite
def request_streams(draw):
    """Prompts that often share prefixes (drawn from a few bases, or from earlier requests)."""
    bases = draw(st.lists(token_lists, min_size=1, max_size=3))
    requests = []
    for _ in range(draw(st.integers(1, 10))):
        base = draw(st.sampled_from(bases + [p + (o or []) for p, o in requests]))
        prompt = base[: draw(st.integers(1, len(base)))] + draw(st.lists(st.integers(0, 3), max_size=6))
        output = draw(st.one_of(st.none(), st.lists(st.integers(0, 3), max_size=5)))
        requests.append((prompt, output))
    return requests


@settings(max_examples=100, deadline=None)
@given(
    requests=request_streams(),
    block_size=st.sampled_from([1, 2, 3, 4, 16]),
    capacities=st.lists(st.integers(0, 80), max_size=4),
)
def test_matches_the_reference_simulator(requests, block_size, capacities):
    sim = simulate([p for p, _ in requests], block_size, [o for _, o in requests])
    cached = [(p, p + (o[:-1] if o else [])) for p, o in requests]
    for capacity in [None, *capacities]:
        assert sim.reusable("token", capacity).tolist() == reference_reuse(cached, 1, capacity)
        assert sim.reusable("block", capacity).tolist() == reference_reuse(cached, block_size, capacity)


@pytest.mark.parametrize("capacity", [0, 3, 16, 10**9])
def test_capacity_never_beats_unlimited(capacity):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 3, size=rng.integers(1, 40)).tolist() for _ in range(60)]
    sim = simulate(prompts, block_size=4)
    for granularity in ("token", "block"):
        limited, unlimited = sim.reusable(granularity, capacity), sim.reusable(granularity)
        assert (limited <= unlimited).all()
        assert capacity < sim.distinct_tokens or (limited == unlimited).all()
