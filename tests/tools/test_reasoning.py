"""Reasoning parsers: what parse() splits recorded outputs into, and that streaming any split gives the same."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagoda.tools import REASONING_PARSERS, ReasoningParser, get_reasoning_parser

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
