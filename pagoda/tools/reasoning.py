"""Reasoning parsers: split a model's output into its reasoning (`<think>...</think>`) and its content.

The rule:
- The reasoning is the text from the start tag (or, with `implicit_start`, from the start of the output) to the
  end tag, or to the end of the output if no end tag comes; the start tag counts only at the very start of the
  output, after optional whitespace.
- The content is the text after the end tag; or, where the output has no reasoning, all of it verbatim.
- Whitespace is trimmed where the chat templates trim it when they replay a turn: around the reasoning, and at the
  start of the content after the end tag (`<think>\\nA\\n</think>\\n\\nB` gives reasoning "A", content "B").
- `parse` gives reasoning None where the output has none (only without `implicit_start`).

Names: `qwen3` has reasoning only when the output opens with `<think>`; `deepseek_r1` reads the output as reasoning
from its start (its chat template puts `<think>` in the prompt), with or without `<think>`.

`parse(text)` is a streamer fed the whole text at once, so "any split of the text into deltas gives the same
reasoning and content" is a property of the streamer alone (tests/tools checks every split).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pagoda.sampling_params import ReasoningSpan
from pagoda.tools.parsers import partial_marker_len


@dataclass(frozen=True)
class ReasoningParser:
    start: str = "<think>"
    end: str = "</think>"
    implicit_start: bool = False  # the output is reasoning from its start even without the start tag

    def streamer(self) -> ReasoningStreamer:
        return ReasoningStreamer(self)

    @property
    def span(self) -> ReasoningSpan:
        """Where the engine finds the thinking in the tokens (for a constraint after it, a budget on it)."""
        return ReasoningSpan(self.end, None if self.implicit_start else self.start)

    def parse(self, text: str) -> tuple[str | None, str]:
        """(reasoning, or None where there is none; content)."""
        streamer = self.streamer()
        reasoning, content = streamer.feed(text)
        reasoning_tail, content_tail = streamer.finish()
        return (reasoning + reasoning_tail if streamer.has_reasoning else None), content + content_tail


class _Trimmed:
    """Passes text on without its leading whitespace and, with `trail`, holds back trailing whitespace until other
    text follows it; whatever is still held back at the end is dropped."""

    def __init__(self, trail: bool) -> None:
        self._trail = trail
        self._started = False
        self._held = ""

    def feed(self, text: str) -> str:
        if not self._started:
            text = text.lstrip()
            self._started = bool(text)
        if not self._trail:
            return text
        text = self._held + text
        kept = text.rstrip()
        self._held = text[len(kept) :]
        return kept


class ReasoningStreamer:
    """One per sequence: fed the text deltas as they are generated, returns (reasoning delta, content delta)."""

    def __init__(self, parser: ReasoningParser) -> None:
        self._parser = parser
        self._text = ""
        self._pos = 0  # everything before it is settled
        self._state = self._at_start
        self._reasoning = _Trimmed(trail=True)
        self._after = _Trimmed(trail=False)  # the content after the end tag
        self.has_reasoning = False  # settled once the output's start is

    def feed(self, delta: str) -> tuple[str, str]:
        self._text += delta
        return self._advance(final=False)

    def finish(self) -> tuple[str, str]:
        return self._advance(final=True)

    def _advance(self, final: bool) -> tuple[str, str]:
        reasoning, content = [], []
        state = None
        while state is not self._state:
            state = self._state
            reasoning_delta, content_delta = state(final)
            reasoning.append(reasoning_delta)
            content.append(content_delta)
        return "".join(reasoning), "".join(content)

    # Each state settles what it can from _pos and returns (reasoning, content); a change of state steps again.

    def _at_start(self, final: bool) -> tuple[str, str]:
        rest = self._text[self._pos :]
        opening = rest.lstrip()
        if opening.startswith(self._parser.start):
            self._pos += len(rest) - len(opening) + len(self._parser.start)
            self._state, self.has_reasoning = self._in_reasoning, True
        elif self._parser.start.startswith(opening) and not final:
            pass  # may still open with the start tag
        elif self._parser.implicit_start:
            self._state, self.has_reasoning = self._in_reasoning, True
        else:
            self._state = self._in_content
        return "", ""

    def _in_reasoning(self, final: bool) -> tuple[str, str]:
        found = self._text.find(self._parser.end, self._pos)
        if found < 0:
            hold = 0 if final else partial_marker_len(self._text, self._parser.end, self._pos)
            end = len(self._text) - hold
            reasoning, self._pos = self._text[self._pos : end], end
            return self._reasoning.feed(reasoning), ""
        reasoning, self._pos = self._text[self._pos : found], found + len(self._parser.end)
        self._state = self._after_reasoning
        return self._reasoning.feed(reasoning), ""

    def _after_reasoning(self, final: bool) -> tuple[str, str]:
        content, self._pos = self._text[self._pos :], len(self._text)
        return "", self._after.feed(content)

    def _in_content(self, final: bool) -> tuple[str, str]:
        content, self._pos = self._text[self._pos :], len(self._text)
        return "", content


@dataclass(frozen=True)
class ReasoningTokenCounter:
    """How many of an output's tokens are its reasoning (usage's `reasoning_tokens`), as the parse
    finds the reasoning. Where the tags are one token each, as in reasoning models' vocabularies: the
    tokens after the start tag (or, with none, from the output's start) and before the first end
    tag, neither tag counted: vLLM's count where the output opens with the start tag (vLLM counts 0
    where it does not, as a deepseek_r1 output whose template wrote the tag, and counts every later
    <think> section too). Where a tag the count needs takes several tokens: the parsed reasoning
    re-tokenized."""

    parser: ReasoningParser
    start_id: int | None  # the start tag's token, None where it takes several
    end_id: int | None
    encode: Callable[[str], list[int]]

    @classmethod
    def of(cls, parser: ReasoningParser, tokenizer) -> ReasoningTokenCounter:
        def encode(text: str) -> list[int]:
            return tokenizer.encode(text, add_special_tokens=False)

        def single(tag: str) -> int | None:
            ids = encode(tag)
            return ids[0] if len(ids) == 1 else None

        return cls(parser, single(parser.start), single(parser.end), encode)

    def count(self, token_ids: list[int], text: str) -> int:
        """The reasoning tokens of one output: its token ids and its whole text."""
        reasoning, _ = self.parser.parse(text)
        if reasoning is None:
            return 0
        end = _position(token_ids, self.end_id, len(token_ids)) if self.parser.end in text else len(token_ids)
        if end is not None and text.lstrip().startswith(self.parser.start):
            start = _position(token_ids, self.start_id, end)
            first = None if start is None else start + 1
        else:
            first = 0  # no start tag: the reasoning runs from the output's start (implicit_start)
        if end is None or first is None:  # a tag the text has is not one token of the output
            return len(self.encode(reasoning)) if reasoning else 0
        return end - first


def _position(token_ids: list[int], tag_id: int | None, stop: int) -> int | None:
    """Where the tag's token first is in token_ids[:stop], None where it is not (or takes several)."""
    if tag_id is None or tag_id not in token_ids[:stop]:
        return None
    return token_ids.index(tag_id, 0, stop)


REASONING_PARSERS: dict[str, ReasoningParser] = {
    "qwen3": ReasoningParser(),
    "deepseek_r1": ReasoningParser(implicit_start=True),
}


def get_reasoning_parser(name: str) -> ReasoningParser:
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of {', '.join(REASONING_PARSERS)}") from None
