"""A request's grammar state with a reasoning model: free while thinking, the grammar's after it,
and, where thinking is optional, a first token that either opens the thinking or starts the answer."""

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
