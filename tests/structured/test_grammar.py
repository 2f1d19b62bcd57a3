"""A request's grammar state with a reasoning model: free while thinking, the grammar's after it,
and, where thinking is optional, a first token that either opens the thinking or starts the answer;
a thinking budget forces the end tag after that many tokens of thinking."""

from __future__ import annotations

import pytest
import torch

from pagoda.model_files import load_tokenizer
from pagoda.sampling_params import StructuredOutputsParams
from pagoda.structured.compiler import GrammarCompiler
from pagoda.structured.grammar import RequestGrammar


@pytest.fixture(scope="module")
def setup(default_model_dir, tmp_path_factory):
    tokenizer = load_tokenizer(default_model_dir)
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id], 60, tmp_path_factory.mktemp("g"))
    compiled = compiler.compile(StructuredOutputsParams(choice=["yes", "no"]))
    yield tokenizer, compiled
    compiler.close()


def ids(tokenizer, text: str) -> tuple[int, ...]:
    return tuple(tokenizer.encode(text, add_special_tokens=False))


def allowed(grammar: RequestGrammar, vocab: int) -> set[int] | None:
    bits = torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32)
    if not grammar.fill_bitmask(bits, 0):
        return None
    flags = (bits[0, :, None] >> torch.arange(32)) & 1
    return set(torch.nonzero(flags.flatten()[:vocab]).flatten().tolist())


def answer(grammar: RequestGrammar, tokenizer, text: str) -> None:
    for token in ids(tokenizer, text) + (tokenizer.eos_token_id,):
        assert grammar.accept_token(token)
    assert grammar.is_terminated()


def test_without_thinking_the_grammar_holds_from_the_start(setup):
    tokenizer, compiled = setup
    grammar = RequestGrammar(compiled)
    first = allowed(grammar, len(tokenizer))
    assert ids(tokenizer, "yes")[0] in first and ids(tokenizer, "no")[0] in first and len(first) < 10
    assert not grammar.accept_token(ids(tokenizer, "maybe")[0])


def test_thinking_from_the_start_is_free_until_the_end_tag(setup):
    tokenizer, compiled = setup
    end = ids(tokenizer, "</think>")
    grammar = RequestGrammar(compiled, (), end)
    for token in ids(tokenizer, "Let me think: maybe, or perhaps not."):
        assert allowed(grammar, len(tokenizer)) is None and grammar.accept_token(token)
    assert not grammar.is_terminated()
    for token in end:
        assert grammar.accept_token(token)
    assert ids(tokenizer, "yes")[0] in allowed(grammar, len(tokenizer))
    answer(grammar, tokenizer, "no")


def test_optional_thinking_opens_with_its_tag_or_answers_at_once(setup):
    tokenizer, compiled = setup
    start, end = ids(tokenizer, "<think>"), ids(tokenizer, "</think>")
    assert len(start) > 1  # SmolLM2 spells the tag in several tokens: the forced rest is exercised
    opening = RequestGrammar(compiled, start, end)
    first = allowed(opening, len(tokenizer))
    assert start[0] in first and ids(tokenizer, "yes")[0] in first
    assert opening.accept_token(start[0])
    assert allowed(opening, len(tokenizer)) == {start[1]}  # committed: the rest of the tag is forced
    for token in start[1:] + ids(tokenizer, "hmm") + end:
        assert opening.accept_token(token)
    answer(opening, tokenizer, "yes")
    direct = RequestGrammar(compiled, start, end)
    answer(direct, tokenizer, "no")  # no thinking: the grammar took the first token


def rows_allowed(bits: torch.Tensor, rows: list[int], vocab: int) -> list[set[int]]:
    flags = (bits[rows, :, None] >> torch.arange(32)) & 1
    return [set(torch.nonzero(f.flatten()[:vocab]).flatten().tolist()) for f in flags]


def test_drafts_are_tried_and_rolled_back(setup):
    """Speculation: valid_prefix cuts a proposal at the first token the grammar refuses and after
    one that completes it; fill_bitmasks gives row i the tokens allowed after drafts[:i]. Neither
    moves the grammar, thinking state included."""
    tokenizer, compiled = setup
    eos, yes, no = tokenizer.eos_token_id, ids(tokenizer, "yes"), ids(tokenizer, "no")
    vocab = len(tokenizer)
    grammar = RequestGrammar(compiled)
    assert grammar.valid_prefix([*yes, eos, *no]) == len(yes) + 1  # nothing after the grammar completes
    assert grammar.valid_prefix([*no, *yes]) == len(no)
    assert grammar.valid_prefix(ids(tokenizer, "maybe")) == 0
    bits = torch.zeros(4, (vocab + 31) // 32, dtype=torch.int32)
    assert grammar.fill_bitmasks(bits, 1, [*yes, eos]) == [1, 2]  # none after the end token
    assert rows_allowed(bits, [1, 2], vocab) == [allowed(RequestGrammar(compiled), vocab), {eos}]
    assert not bits[[0, 3]].any()
    answer(grammar, tokenizer, "no")  # untouched: it still takes either answer

    end = ids(tokenizer, "</think>")
    thinking = RequestGrammar(compiled, (), end)
    bits = torch.zeros(len(end) + 2, (vocab + 31) // 32, dtype=torch.int32)
    masked = thinking.fill_bitmasks(bits, 0, [*end, yes[0]])
    assert masked == [len(end), len(end) + 1]  # free while thinking; the grammar's after the tag
    assert yes[0] in rows_allowed(bits, [len(end)], vocab)[0]
    assert thinking.valid_prefix([*end, *ids(tokenizer, "maybe")]) == len(end)
    assert allowed(thinking, vocab) is None  # still thinking
    for token in ids(tokenizer, "hmm") + end:
        assert thinking.accept_token(token)
    answer(thinking, tokenizer, "yes")


def forced(grammar: RequestGrammar, vocab: int) -> int | None:
    """The one token the mask allows, None where it allows more (or masks nothing)."""
    tokens = allowed(grammar, vocab)
    return next(iter(tokens)) if tokens is not None and len(tokens) == 1 else None


@pytest.mark.parametrize("budget", [0, 1, 4])
def test_a_thinking_budget_forces_the_end_tag_once_spent(setup, budget):
    """Thinking from the first token (deepseek_r1's span), no constraint: `budget` tokens free, then
    the end tag's tokens one at a time (nothing else accepted), then a free answer that never ends
    the output by itself (min_tokens and EOS decide, not the grammar)."""
    tokenizer, _ = setup
    vocab, end = len(tokenizer), ids(tokenizer, "</think>")
    grammar = RequestGrammar(None, (), end, budget)
    assert not grammar.decides_end
    for token in ids(tokenizer, "Let me think: maybe, or perhaps not.")[:budget]:
        assert allowed(grammar, vocab) is None and grammar.accept_token(token)
    for token in end:
        assert forced(grammar, vocab) == token
        assert not grammar.valid_prefix([token + 1])  # a draft of any other token is cut
        assert grammar.accept_token(token)
    for token in ids(tokenizer, "The answer.") + (tokenizer.eos_token_id,):
        assert allowed(grammar, vocab) is None and grammar.accept_token(token)
    assert not grammar.is_terminated()


@pytest.mark.parametrize("begun", [1, 2])
def test_an_end_tag_the_model_has_begun_when_the_budget_runs_out_is_finished_not_restarted(setup, begun):
    tokenizer, _ = setup
    vocab, end = len(tokenizer), ids(tokenizer, "</think>")
    assert len(end) == 3  # SmolLM2 spells it in three tokens
    grammar = RequestGrammar(None, (), end, budget=1 + begun)
    for token in ids(tokenizer, "ok") + end[:begun]:
        assert grammar.accept_token(token)
    for token in end[begun:]:
        assert forced(grammar, vocab) == token and grammar.accept_token(token)
    assert allowed(grammar, vocab) is None  # answering


def test_thinking_that_ends_within_its_budget_is_left_alone(setup):
    tokenizer, _ = setup
    vocab, end = len(tokenizer), ids(tokenizer, "</think>")
    grammar = RequestGrammar(None, (), end, budget=len(end) + 2)
    for token in ids(tokenizer, "ok") + end + ids(tokenizer, " and a long answer after it, not cut"):
        assert allowed(grammar, vocab) is None and grammar.accept_token(token)


def test_a_budget_on_optional_thinking_with_a_constraint(setup):
    """qwen3's span (thinking only where the output opens with <think>) under a choice: the tag's
    tokens are not counted, the budget's tokens are free, the end is forced, then the grammar's."""
    tokenizer, compiled = setup
    vocab = len(tokenizer)
    start, end = ids(tokenizer, "<think>"), ids(tokenizer, "</think>")
    grammar = RequestGrammar(compiled, start, end, budget=2)
    assert grammar.decides_end
    for token in start + ids(tokenizer, "hmm well")[:2]:
        assert grammar.accept_token(token)
    bits = torch.zeros(len(end) + 2, (vocab + 31) // 32, dtype=torch.int32)
    assert grammar.fill_bitmasks(bits, 0, [*end, ids(tokenizer, "yes")[0]]) == list(range(len(end) + 2))
    assert rows_allowed(bits, list(range(len(end))), vocab) == [{token} for token in end]
    assert grammar.valid_prefix([*end, *ids(tokenizer, "maybe")]) == len(end)  # tried, rolled back
    assert forced(grammar, vocab) == end[0]
    for token in end:
        assert grammar.accept_token(token)
    answer(grammar, tokenizer, "no")
    unopened = RequestGrammar(None, start, end, budget=0)  # no constraint: leaving the tag is answering
    assert allowed(unopened, vocab) is None and unopened.accept_token(start[0])
    assert allowed(unopened, vocab) is None and unopened.accept_token(start[1] + 1)
    assert allowed(unopened, vocab) is None  # it answers: nothing forced
