"""Beam search (vLLM's LLM.beam_search): the search's rules on scripted candidates, and on the
default model: one beam is greedy decoding, and each beam's cumulative logprob is the model's own
for its tokens, the beams ranked best first."""

from __future__ import annotations

import math

import pytest

from pagoda import BeamSearchParams, SamplingParams
from pagoda.beam_search import BeamSearch

EOS = frozenset({9})
# prompt [0]; the candidates each beam gets at each step, by its tokens
SCRIPT = {
    (0,): {1: -0.1, 2: -0.5, 9: -1.0, 3: -2.0},
    (0, 1): {4: -3.0, 5: -4.0},
    (0, 2): {6: -0.2, 9: -0.1},
    (0, 2, 6): {7: -0.1},
    (0, 1, 4): {8: -0.1},
}


def run(params: BeamSearchParams, max_model_len: int = 100) -> list[tuple[list[int], float, str]]:
    search = BeamSearch([0], params, EOS, max_model_len)
    while not search.done:
        search.advance([SCRIPT[tuple(beam.tokens)] for beam in search.beams])
    return [(beam.tokens, round(beam.cum_logprob, 6), beam.finish_reason) for beam in search.best()]


def test_the_search_keeps_the_best_extensions_and_ranks_by_length_penalized_score():
    # step 1 ends [0] (EOS, -1.0) and keeps [0,1] and [0,2]; step 2 ends [0,2] (-0.6) and keeps
    # [0,2,6] (-0.7) over [0,1,4] (-3.1) and [0,1,5]; step 3 makes [0,2,6,7] (-0.8), [0,1,4,8] (-3.2)
    params = BeamSearchParams(beam_width=2, max_tokens=3)
    assert run(params) == [([0, 2, 6, 7], -0.8, "length"), ([0, 2], -0.6, "stop")]  # -0.8 / 4 > -0.6 / 2
    unpenalized = BeamSearchParams(beam_width=2, max_tokens=3, length_penalty=0.0)
    assert run(unpenalized) == [([0, 2], -0.6, "stop"), ([0, 2, 6, 7], -0.8, "length")]
    kept = BeamSearchParams(beam_width=2, max_tokens=3, include_stop_str_in_output=True)
    assert run(kept) == [([0, 2, 6, 7], -0.8, "length"), ([0, 2, 9], -0.6, "stop")]  # the end token not counted


def test_beams_that_fill_the_context_end_as_length():
    """Beams stop growing where they fill max_model_len, as generate's sequences do, ending "length"."""
    params = BeamSearchParams(beam_width=2, max_tokens=3)
    assert run(params, max_model_len=3) == [([0, 2, 6], -0.7, "length"), ([0, 2], -0.6, "stop")]


def test_a_beam_wider_than_max_logprobs_allows_is_refused_naming_both():
    from pagoda import LLM

    llm = LLM(kv_cache_memory=0.1, max_model_len=64, max_logprobs=3)
    with pytest.raises(ValueError, match=r"beam_width 2 needs the logprobs of 4 tokens.*max_logprobs \(3\)"):
        llm.beam_search(["Hi"], BeamSearchParams(beam_width=2, max_tokens=2))
    (output,) = llm.beam_search(["Hi"], BeamSearchParams(beam_width=1, max_tokens=2))
    assert len(output.sequences) == 1


def test_beam_search_at_the_context_limit_answers(default_llm):
    """A prompt a token short of the context: the beams end there, "length", where the search failed."""
    limit = default_llm.engine.config.model.max_model_len
    params = BeamSearchParams(beam_width=2, max_tokens=20, ignore_eos=True)
    (output,) = default_llm.beam_search([[5] * (limit - 2)], params)
    assert [(len(beam.tokens), beam.finish_reason) for beam in output.sequences] == [(limit, "length")] * 2


def test_ignore_eos_extends_through_the_end_token():
    search = BeamSearch([0], BeamSearchParams(beam_width=1, max_tokens=1, ignore_eos=True), EOS, 100)
    search.advance([{9: -0.1, 1: -0.5}])
    assert [(b.tokens, b.finish_reason) for b in search.best()] == [([0, 9], "length")]


def test_params_are_checked():
    for bad in ({"beam_width": 0, "max_tokens": 1}, {"beam_width": 1, "max_tokens": 0}):
        with pytest.raises(ValueError, match="at least 1"):
            BeamSearchParams(**bad)
    with pytest.raises(ValueError, match="beam_width must be at most 10"):
        BeamSearchParams(beam_width=11, max_tokens=1)  # its steps would ask 22 logprobs


PROMPTS = ["The capital of France is", [1, 520, 3000, 44, 901]]


def test_one_beam_is_greedy_decoding(default_llm):
    beam = default_llm.beam_search(PROMPTS[:1], BeamSearchParams(beam_width=1, max_tokens=12))[0].sequences[0]
    greedy = default_llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    assert beam.tokens == greedy.prompt_token_ids + greedy.outputs[0].token_ids
    assert beam.text == default_llm.tokenizer.decode(beam.tokens, skip_special_tokens=True)


def test_beams_carry_the_models_logprobs_best_first(default_llm):
    params = BeamSearchParams(beam_width=3, max_tokens=8)
    for prompt, output in zip(PROMPTS, default_llm.beam_search(PROMPTS, params)):
        prompt_len = len(default_llm.engine.encode(prompt) if isinstance(prompt, str) else prompt)
        scores = []
        for beam in output.sequences:
            tokens = beam.tokens  # a finished beam keeps its end token offline (vLLM's)
            assert beam.finish_reason == "length" or tokens[-1] == beam.stop_reason
            scored = default_llm.generate([tokens], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[
                0
            ].prompt_logprobs
            own = sum(scored[i][token].logprob for i, token in enumerate(tokens) if i >= prompt_len)
            assert math.isclose(beam.cum_logprob, own, abs_tol=1e-4), (beam.tokens, beam.cum_logprob, own)
            scores.append(beam.cum_logprob / len(beam.tokens))
        assert len({tuple(b.tokens) for b in output.sequences}) == 3 and scores == sorted(scores, reverse=True)
