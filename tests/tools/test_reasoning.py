"""Reasoning parsers: what parse() splits recorded outputs into, and that streaming any split gives the same."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagoda.tools import REASONING_PARSERS, ReasoningParser, get_reasoning_parser
from pagoda.tools.reasoning import ReasoningTokenCounter

from .test_parsers import split

# (parser, text, reasoning, content)
CASES = [
    ("qwen3", "<think>\nThe user wants 2 + 2.\n</think>\n\nIt is 4.", "The user wants 2 + 2.", "It is 4."),
    ("qwen3", "<think>\n\n</think>\n\nIt is 4.", "", "It is 4."),
    ("qwen3", "\n<think>Ça fait 4 😀</think>C'est 4.\n", "Ça fait 4 😀", "C'est 4.\n"),
    ("qwen3", "It is 4.", None, "It is 4."),
    ("qwen3", "  It is 4.</think> ", None, "  It is 4.</think> "),
    ("qwen3", "<thinking>It is 4.", None, "<thinking>It is 4."),
    ("qwen3", "<thi", None, "<thi"),
    ("qwen3", " \n", None, " \n"),
    ("qwen3", "", None, ""),
    ("qwen3", "<think>\nStill thinking when the tokens ran out\n", "Still thinking when the tokens ran out", ""),
    ("qwen3", "<think>a </thi b\n\n</think>", "a </thi b", ""),
    ("qwen3", "<think>a</think>b</think>c <think>d", "a", "b</think>c <think>d"),
    ("deepseek_r1", "The user wants 2 + 2.\n</think>\n\nIt is 4.", "The user wants 2 + 2.", "It is 4."),
    ("deepseek_r1", "<think>\nThe user wants 2 + 2.\n</think>\n\nIt is 4.", "The user wants 2 + 2.", "It is 4."),
    ("deepseek_r1", "It is 4.", "It is 4.", ""),
    ("deepseek_r1", "</think>It is 4.", "", "It is 4."),
    ("deepseek_r1", "<thi", "<thi", ""),
    ("deepseek_r1", "", "", ""),
]
IDS = [f"{name}-{i}" for i, (name, *_) in enumerate(CASES)]
PIECES = ["<think>", "</think>", "<thi", "</th", "<", "\n", " ", "a", "é😀"]


def stream(parser: ReasoningParser, chunks: list[str]) -> tuple[str, str]:
    streamer = parser.streamer()
    deltas = [streamer.feed(chunk) for chunk in chunks] + [streamer.finish()]
    return "".join(reasoning for reasoning, _ in deltas), "".join(content for _, content in deltas)


@pytest.mark.parametrize("name, text, reasoning, content", CASES, ids=IDS)
def test_parse_recorded_output(name, text, reasoning, content):
    assert REASONING_PARSERS[name].parse(text) == (reasoning, content)


@pytest.mark.parametrize("name, text, reasoning, content", CASES, ids=IDS)
def test_streaming_every_two_way_and_one_char_split(name, text, reasoning, content):
    parser = REASONING_PARSERS[name]
    expected = (reasoning or "", content)
    assert stream(parser, list(text)) == expected
    for cut in range(len(text) + 1):
        assert stream(parser, split(text, {cut})) == expected, cut


@pytest.mark.parametrize("name", list(REASONING_PARSERS))
@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_streaming_random_text(name, data):
    parser = REASONING_PARSERS[name]
    text = "".join(data.draw(st.lists(st.sampled_from(PIECES), max_size=12)))
    cuts = data.draw(st.sets(st.integers(0, len(text))))
    reasoning, content = parser.parse(text)
    assert stream(parser, split(text, cuts)) == (reasoning or "", content)


def test_reasoning_streams_before_the_end():
    streamer = REASONING_PARSERS["qwen3"].streamer()
    assert streamer.feed(" <th") == ("", "")
    assert streamer.feed("ink>\nFirst, ") == ("First,", "")
    assert streamer.feed("add. </th") == (" add.", "")
    assert streamer.feed("ink>\n\n") == ("", "")
    assert streamer.feed("4") == ("", "4")
    assert streamer.finish() == ("", "")


def test_custom_tags_and_names():
    assert ReasoningParser("<reasoning>", "</reasoning>").parse("<reasoning>a</reasoning>b") == ("a", "b")
    assert get_reasoning_parser("deepseek_r1") is REASONING_PARSERS["deepseek_r1"]
    with pytest.raises(ValueError, match="qwen3, deepseek_r1"):
        get_reasoning_parser("granite")


@pytest.fixture(scope="module")
def tokenizers():
    """The default model's tokenizer, in which the tags take several tokens each, and a copy with
    them added as one token each (as reasoning models' vocabularies have them)."""
    import copy

    from pagoda.model_files import load_tokenizer

    plain = load_tokenizer(None)
    tagged = copy.deepcopy(plain)
    tagged.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    return plain, tagged


@pytest.mark.parametrize(("name", "text", "reasoning", "content"), CASES, ids=IDS)
def test_reasoning_tokens_are_those_between_the_tags(name, text, reasoning, content, tokenizers):
    """With one-token tags, the tokens strictly between the start tag (or the output's start) and
    the first end tag: the text between them encoded alone, since a special token splits the text
    around it. With tags of several tokens, the parsed reasoning re-tokenized."""
    plain, tagged = tokenizers
    parser = REASONING_PARSERS[name]
    counter = ReasoningTokenCounter.of(parser, tagged)
    assert counter.start_id is not None and counter.end_id is not None
    between = text.lstrip()[len(parser.start) :] if text.lstrip().startswith(parser.start) else text
    between = between.split(parser.end, 1)[0]
    want = 0 if reasoning is None else len(tagged.encode(between, add_special_tokens=False))
    assert counter.count(tagged.encode(text, add_special_tokens=False), text) == want

    fallback = ReasoningTokenCounter.of(parser, plain)
    assert fallback.end_id is None  # "</think>" is several tokens of the default vocabulary
    want = 0 if reasoning is None else len(plain.encode(reasoning, add_special_tokens=False))
    assert fallback.count(plain.encode(text, add_special_tokens=False), text) == want


def test_a_tag_written_in_pieces_falls_back_to_the_reasoning_re_tokenized(tokenizers):
    """A model of a one-token-tag vocabulary that spells the end tag in pieces: no end token to stop
    at, so the count does not run on into the content."""
    _, tagged = tokenizers
    counter = ReasoningTokenCounter.of(REASONING_PARSERS["qwen3"], tagged)
    pieces = [tagged.convert_tokens_to_ids("<think>")] + tagged.encode("ab</", add_special_tokens=False)
    pieces += tagged.encode("think>cd efg", add_special_tokens=False)
    text = tagged.decode(pieces)
    assert text == "<think>ab</think>cd efg" and counter.end_id not in pieces
    assert counter.count(pieces, text) == len(tagged.encode("ab", add_special_tokens=False))
