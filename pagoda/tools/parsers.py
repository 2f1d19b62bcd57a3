"""Tool-call parsers: find the calls in a model's output text, whole or as it streams.

Formats (named as vLLM's `--tool-call-parser` values where they exist):
- `hermes` (Hermes, Qwen2.5, Qwen3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number.
- `llama3_json` (Llama 3.1/3.2): the whole output is `{"name": ..., "parameters": {...}}` (or "arguments"),
  optionally after `<|python_tag|>`; several are separated by `;`.
- `mistral`: `[TOOL_CALLS]` then a JSON array of `{"name": ..., "arguments": {...}}`; or, as v11+ tokenizers'
  models (Magistral, Devstral) write a call, `[TOOL_CALLS]name[ARGS]{...}` (`[ARGS]` optional), one marker a call.
- `granite` (IBM Granite 3): `<|tool_call|>` (3.0, a special token) or `<tool_call>` (3.1+) then a JSON array of
  `{"name": ..., "arguments": {...}}`, which ends the call (no closing marker); text around it is content.
- `pythonic` (Llama 3.2 with its pythonic template, Llama 4, ToolACE): the output opens with a Python list of calls
  with keyword arguments of literal values, `[get_weather(city="Paris"), get_time(zone='UTC')]`.
- `generic`: Pagoda's own, for chat templates without tools: the whole output is
  `{"tool_calls": [{"name": ..., "arguments": {...}}]}` (pagoda/tools/prompt.py tells the model).

Rules every format keeps:
- A call's `arguments` is its arguments object re-serialized by `json.dumps(obj, ensure_ascii=False)`, so streamed
  and whole results are byte-identical. A call with no name is malformed; one with no arguments gets `{}`.
- Nothing raises on model output. A malformed or incomplete call (bad JSON, no name, arguments not an object; for
  mistral, any bad element of the array; for the whole-output formats, anything that is not entirely calls) stays
  in `content` as its raw text, and no call is reported for it.
- Content is the text outside the calls, verbatim, except that a stretch of it that is only whitespace and borders
  a call (before, between or after calls) is dropped.
- Calls a grammar holds (HELD_PARSERS: forced calls, and the calls a structural tag holds under "auto") are read as
  the grammar writes them and sent as they come, their arguments the model's own text.
- `parse(text)` is a streamer fed the whole text at once, so the invariant "any split of the text into deltas gives
  the same content and calls" is a property of the streamers alone (tests/tools checks every split).

A streamer decides nothing before the text decides it: it holds back a tail that may be the start of a marker, a
call until it is complete, and a whole-output format's text while it may still be nothing but calls.
"""

from __future__ import annotations

import ast
import json
import os
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object as text, exactly as it will be returned to the client


@dataclass(frozen=True)
class ParsedOutput:
    content: str  # text outside any tool call ("" if none)
    tool_calls: list[ToolCall]
    calls_whole: bool = True  # False: the text ended inside a call a grammar held, whose arguments stop there


@dataclass(frozen=True)
class ToolCallDelta:
    """One streaming event of one call: the first of a call carries its name."""

    index: int  # which call (0, 1, ...)
    name: str | None  # set once, on the call's first delta
    arguments: str  # a fragment of the arguments text ("" allowed on the first delta)


# What a streamer settles, in the order of the text: stretches of content and events of calls (text after a call
# comes after it, so that a Responses answer's items and a stream's deltas keep the model's order)
Piece = str | ToolCallDelta


def content_of(pieces: list[Piece]) -> str:
    return "".join(piece for piece in pieces if isinstance(piece, str))


def calls_of(pieces: list[Piece]) -> list[ToolCallDelta]:
    return [piece for piece in pieces if isinstance(piece, ToolCallDelta)]


def _settled(*pieces: Piece) -> list[Piece]:
    """The pieces without empty stretches of content."""
    return [piece for piece in pieces if piece != ""]


class ToolStreamer:
    """One per sequence: fed the text deltas as they are generated."""

    def feed(self, delta: str) -> list[Piece]:
        """The content and tool-call deltas that `delta` settles, in order."""
        raise NotImplementedError

    def finish(self) -> list[Piece]:
        """Flush at the end of the sequence: whatever was held back is settled now."""
        raise NotImplementedError

    def calls_whole(self) -> bool:
        """After finish(): whether every call it sent is whole. A parser that reads a model's own calls sends
        only whole ones; calls a grammar holds are sent as they come, so a text cut short (max_tokens, a stop
        string) leaves its last call, or the calls' closing, unfinished."""
        return True


Known = Callable[[str], bool]  # whether a call's name is one of the request's tools


def _any_name(name: str) -> bool:
    return True


@dataclass(frozen=True)
class ToolParser:
    """One per format; stateless. Its streamers take `known`: a call naming no known tool is
    malformed (its text stays content, as any malformed call's), since no client can run it."""

    name: str
    new_streamer: Callable[[Known], ToolStreamer]
    # its markers may be special tokens (Mistral's [TOOL_CALLS], some Hermes models' <tool_call>): the requests it
    # reads keep special tokens in their text, as vLLM's parsers of these formats ask
    keeps_special_tokens: bool = False

    def streamer(self, known: Known = _any_name) -> ToolStreamer:
        return self.new_streamer(known)

    def parse(self, text: str, known: Known = _any_name) -> ParsedOutput:
        streamer = self.new_streamer(known)
        pieces = streamer.feed(text) + streamer.finish()
        return ParsedOutput(content_of(pieces), assemble(calls_of(pieces)), streamer.calls_whole())


def assemble(deltas: list[ToolCallDelta]) -> list[ToolCall]:
    """The calls that a stream of deltas describes (indices count up from 0, each name on its call's first delta)."""
    names: list[str] = []
    arguments: list[list[str]] = []
    for delta in deltas:
        if delta.index == len(names):
            assert delta.name is not None, delta
            names.append(delta.name)
            arguments.append([])
        arguments[delta.index].append(delta.arguments)
    return [ToolCall(name, "".join(parts)) for name, parts in zip(names, arguments)]


# ---- reading calls -------------------------------------------------------------------------------------------------


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _loads(text: str) -> Any:
    """The JSON value of `text`, or None where it is not strict JSON (NaN and Infinity are refused)."""
    try:
        return json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError):  # json.JSONDecodeError, _no_constant's, and absurd nesting
        return None


def _tool_call(obj: Any) -> ToolCall | None:
    """A call from `{"name": str, "arguments" (or "parameters"): object}`, or None where it is malformed."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    arguments = obj["arguments"] if "arguments" in obj else obj.get("parameters", {})
    if not isinstance(arguments, dict):
        return None
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


def _tool_calls(items: Any) -> list[ToolCall] | None:
    """Calls from a non-empty JSON array of them; None if any one is malformed."""
    if not isinstance(items, list) or not items:
        return None
    calls = [_tool_call(item) for item in items]
    return [call for call in calls if call is not None] if all(calls) else None


def partial_marker_len(text: str, marker: str, start: int = 0) -> int:
    """Length of the longest tail of text[start:] that is a proper prefix of `marker` (text to hold back)."""
    for size in range(min(len(marker) - 1, len(text) - start), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0


def _next_marker(text: str, start: int, markers: tuple[str, ...], final: bool) -> tuple[int, str | None]:
    """Where the text from `start` is settled up to (the first of `markers` found, else its end less a tail
    that may begin one, unless `final`), and the marker found there (None if none is in sight)."""
    seen = [(at, marker) for marker in markers if (at := text.find(marker, start)) >= 0]
    if seen:
        return min(seen)
    held = 0 if final else max(partial_marker_len(text, marker, start) for marker in markers)
    return len(text) - held, None


JSON_SPACE = " \t\n\r"  # whitespace as JSON has it (and the grammars that hold calls, tags.py): not str.isspace's


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in JSON_SPACE:
        pos += 1
    return pos


class _JsonExtent:
    """Finds where the JSON object or array that opens at `start` closes, reading the text as it grows.

    Only strings and brackets are followed (json.loads validates the value once its extent is known), and the scan
    resumes where it stopped, so a long value costs one pass however finely it streams."""

    def __init__(self, start: int) -> None:
        self.start = start
        self._pos = start
        self._depth = 0
        self._in_string = False
        self._escaped = False

    def end(self, text: str) -> int | None:
        """The index just past the closing bracket, or None while it has not come."""
        for i in range(self._pos, len(text)):
            char = text[i]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "[{":
                self._depth += 1
            elif char in "]}":
                self._depth -= 1
                if self._depth == 0:
                    return i + 1
        self._pos = len(text)
        return None


# ---- formats with a marker before each call ------------------------------------------------------------------------


class _Output:
    """Collects a tagged streamer's events and applies the whitespace rule: a run of text between calls (or before
    the first, or after the last) that is only whitespace is held back, and dropped if a call borders it."""

    def __init__(self) -> None:
        self._pieces: list[Piece] = []
        self._run = ""  # the current run while it is only whitespace
        self._run_shown = False  # the current run had other text, so it passes through
        self._calls = 0

    def text(self, text: str) -> None:
        if self._run_shown:
            self._content(text)
            return
        self._run += text
        if self._run and not self._run.isspace():
            self._content(self._run)
            self._run, self._run_shown = "", True

    def call(self, call: ToolCall) -> None:
        self.open_call(call.name, call.arguments)

    def open_call(self, name: str, arguments: str = "") -> None:
        """A call's first delta, its name (with its arguments where they came whole)."""
        self._run, self._run_shown = "", False
        self._pieces.append(ToolCallDelta(self._calls, name, arguments))
        self._calls += 1

    def arguments(self, fragment: str) -> None:
        """A piece of the last call's arguments."""
        if fragment:
            self._pieces.append(ToolCallDelta(self._calls - 1, None, fragment))

    def close(self) -> None:
        if self._calls == 0:
            self._content(self._run)
        self._run = ""

    def take(self) -> list[Piece]:
        pieces, self._pieces = self._pieces, []
        return pieces

    def _content(self, text: str) -> None:
        if not text:
            return
        if self._pieces and isinstance(self._pieces[-1], str):
            self._pieces[-1] += text
        else:
            self._pieces.append(text)


class _EndTag:
    """The extent of a call that runs to the first `tag` after `start`."""

    def __init__(self, tag: str, start: int) -> None:
        self._tag = tag
        self._pos = start

    def end(self, text: str) -> int | None:
        found = text.find(self._tag, self._pos)
        if found < 0:
            self._pos = max(self._pos, len(text) - len(self._tag) + 1)
            return None
        return found + len(self._tag)


class _CallsArray:
    """The extent of the calls after a marker (at `start`): the JSON array after whitespace; if none comes, the
    extent is empty, so the marker alone is read (as malformed) and the text after it as text."""

    def __init__(self, start: int) -> None:
        self._start = start
        self._json: _JsonExtent | None = None

    def end(self, text: str) -> int | None:
        if self._json is None:
            pos = _skip_space(text, self._start)
            if pos == len(text):
                return None
            opening = pos if text[pos] == "[" else self._not_an_array(text, pos)
            if opening is None:
                return None
            if opening < 0:
                return self._start
            self._json = _JsonExtent(opening)
        return self._json.end(text)

    def _not_an_array(self, text: str, pos: int) -> int | None:
        """Where the calls' JSON opens when the text at `pos` opens no array; None while that may still come,
        -1 where none will."""
        return -1


class _MistralCalls(_CallsArray):
    """`[TOOL_CALLS]`'s: the JSON array, or a function name, an optional `[ARGS]` and (after whitespace) the JSON
    object of its arguments."""

    def _not_an_array(self, text: str, pos: int) -> int | None:
        name = _MISTRAL_NAME.match(text, pos)
        if name is None:
            return -1
        after = name.end()
        if text.startswith(MISTRAL_ARGS, after):
            after += len(MISTRAL_ARGS)
        elif MISTRAL_ARGS.startswith(text[after:]):  # the name, or `[ARGS]`, may still be coming
            return None
        after = _skip_space(text, after)
        if after == len(text):
            return None
        return after if text[after] == "{" else -1


class _Extent(Protocol):  # _EndTag or _CallsArray
    def end(self, text: str) -> int | None: ...


class _TaggedStreamer(ToolStreamer):
    """Text, then a marker that opens a call, then text again, any number of times."""

    def __init__(
        self,
        markers: tuple[str, ...],
        extent: Callable[[int], _Extent],
        read: Callable[[str], list[ToolCall] | None],
    ) -> None:
        self._markers = markers  # any of them opens a call (none is a prefix of another)
        self._extent = extent  # given where the call's body starts, finds where the call ends
        self._read = read  # the calls in a call's raw text, marker included; None if malformed
        self._text = ""
        self._pos = 0  # everything before it is settled
        self._call: _Extent | None = None  # set while inside a call that opened at _pos
        self._out = _Output()

    def feed(self, delta: str) -> list[Piece]:
        self._text += delta
        self._advance(final=False)
        return self._out.take()

    def finish(self) -> list[Piece]:
        self._advance(final=True)
        self._out.close()
        return self._out.take()

    def _advance(self, final: bool) -> None:
        while self._call is not None or self._open_call(final):
            end = self._call.end(self._text)
            if end is None:
                if final:
                    self._settle_text(len(self._text))
                return
            calls = self._read(self._text[self._pos : end])
            if calls is None:
                self._out.text(self._text[self._pos : end])
            for call in calls or ():
                self._out.call(call)
            self._pos, self._call = end, None

    def _open_call(self, final: bool) -> bool:
        """Settles the text before the next marker and opens a call at it; False if no marker is in sight."""
        found, marker = _next_marker(self._text, self._pos, self._markers, final)
        self._settle_text(found)
        if marker is None:
            return False
        self._call = self._extent(found + len(marker))
        return True

    def _settle_text(self, end: int) -> None:
        self._out.text(self._text[self._pos : end])
        self._pos, self._call = end, None


HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
MISTRAL_MARKER = "[TOOL_CALLS]"
GRANITE_MARKERS = ("<|tool_call|>", HERMES_START)  # Granite 3.0's special token, 3.1's text
MISTRAL_ARGS = "[ARGS]"
_MISTRAL_NAME = re.compile(r"[A-Za-z0-9_.-]+")  # OpenAI's characters of a function name


def _read_hermes(raw: str) -> list[ToolCall] | None:
    call = _tool_call(_loads(raw[len(HERMES_START) : -len(HERMES_END)]))
    return None if call is None else [call]


def _read_mistral(raw: str) -> list[ToolCall] | None:
    body = raw[len(MISTRAL_MARKER) :].lstrip()
    if body.startswith("["):
        return _tool_calls(_loads(body))
    name = _MISTRAL_NAME.match(body)
    arguments = _loads(body[name.end() :].removeprefix(MISTRAL_ARGS)) if name else None
    if not isinstance(arguments, dict):
        return None
    return [ToolCall(name.group(), json.dumps(arguments, ensure_ascii=False))]


def _read_granite(raw: str) -> list[ToolCall] | None:
    marker = next(marker for marker in GRANITE_MARKERS if raw.startswith(marker))
    return _tool_calls(_loads(raw[len(marker) :].lstrip()))


def _known_only(read: Callable[[str], list[ToolCall] | None], known: Known) -> Callable[[str], list[ToolCall] | None]:
    """`read`, with calls that name an unknown tool read as malformed (None)."""

    def checked(raw: str) -> list[ToolCall] | None:
        calls = read(raw)
        return calls if calls is None or all(known(call.name) for call in calls) else None

    return checked


def _hermes_streamer(known: Known) -> ToolStreamer:
    end_tag = lambda start: _EndTag(HERMES_END, start)  # noqa: E731
    return _TaggedStreamer((HERMES_START,), end_tag, _known_only(_read_hermes, known))


def _mistral_streamer(known: Known) -> ToolStreamer:
    return _TaggedStreamer((MISTRAL_MARKER,), _MistralCalls, _known_only(_read_mistral, known))


def _granite_streamer(known: Known) -> ToolStreamer:
    return _TaggedStreamer(GRANITE_MARKERS, _CallsArray, _known_only(_read_granite, known))


# ---- formats where the whole output is the calls -------------------------------------------------------------------


class _HeldStreamer(ToolStreamer):
    """A whole-output format's streamer: its text is held back until `_advance` decides what it is (and returns
    what is settled); once it sets `_content`, the rest of the output passes through as content."""

    _text: str
    _content: bool

    def feed(self, delta: str) -> list[Piece]:
        self._text += delta
        if self._content:
            return _settled(delta)
        return self._advance(final=False)

    def finish(self) -> list[Piece]:
        if self._content:
            return []
        return self._advance(final=True)

    def _advance(self, final: bool) -> list[Piece]:
        raise NotImplementedError


class _WholeStreamer(_HeldStreamer):
    """The output opens with calls or it is content: optional whitespace, an optional `prefix`, then JSON objects
    (separated by `separator` where there is one) with whitespace around them. The text is held back while it may
    still be that; the first sign that it is not releases the calls read so far and the text after them (all of
    the text where there are none) as content, and lets the rest pass through, as text after a tagged call does."""

    def __init__(self, prefix: str | None, separator: str | None, read: Callable[[str], list[ToolCall] | None]):
        self._prefix = prefix
        self._separator = separator
        self._read = read  # the calls in one JSON object's text; None if it is not a call object
        self._text = ""
        self._pos = 0
        self._state = self._at_start
        self._object: _JsonExtent | None = None
        self._calls: list[ToolCall] = []
        self._calls_end = 0  # where the text after the calls read so far begins (past a separator that follows them)
        self._content = False  # decided: the rest of the output is content

    def _advance(self, final: bool) -> list[Piece]:
        """Steps until the text runs out; then the calls and any content after them, or (before the end) nothing."""
        verdict = None
        while verdict is None:
            verdict = self._state(final)
        if verdict == "wait":
            return []
        deltas = [ToolCallDelta(i, call.name, call.arguments) for i, call in enumerate(self._calls)]
        if verdict == "calls":
            return list(deltas)
        self._content = True
        return _settled(*deltas, self._text[self._calls_end :])

    # Each state reads from _pos and returns None to go on, "wait" (more text could decide), "content" or "calls".

    def _at_start(self, final: bool) -> str | None:
        pos = _skip_space(self._text, self._pos)
        rest = self._text[pos:]
        if self._prefix and rest.startswith(self._prefix):
            pos += len(self._prefix)
        elif not rest or (self._prefix and self._prefix.startswith(rest)):
            self._pos = pos  # whitespace read once: a long run of it streams in linear time
            return "content" if final else "wait"
        self._pos, self._state = pos, self._at_object
        return None

    def _at_object(self, final: bool) -> str | None:
        pos = _skip_space(self._text, self._pos)
        if pos == len(self._text):
            self._pos = pos
            if not final:
                return "wait"
            return "calls" if self._calls else "content"
        if self._text[pos] != "{":
            return "content"
        self._object, self._state = _JsonExtent(pos), self._in_object
        return None

    def _in_object(self, final: bool) -> str | None:
        assert self._object is not None
        end = self._object.end(self._text)
        if end is None:
            return "content" if final else "wait"
        calls = self._read(self._text[self._object.start : end])
        if calls is None:
            return "content"
        self._calls += calls
        self._pos = self._calls_end = end
        self._state = self._after_object
        return None

    def _after_object(self, final: bool) -> str | None:
        pos = _skip_space(self._text, self._pos)
        if pos == len(self._text):
            self._pos = pos
            return "calls" if final else "wait"
        if self._text[pos] != self._separator:
            return "content"
        self._pos = self._calls_end = pos + 1
        self._state = self._at_object
        return None


LLAMA3_PYTHON_TAG = "<|python_tag|>"


def _read_llama3(text: str) -> list[ToolCall] | None:
    call = _tool_call(_loads(text))
    return None if call is None else [call]


def _read_generic(text: str) -> list[ToolCall] | None:
    obj = _loads(text)
    return _tool_calls(obj.get("tool_calls")) if isinstance(obj, dict) else None


def _llama3_streamer(known: Known) -> ToolStreamer:
    return _WholeStreamer(LLAMA3_PYTHON_TAG, ";", _known_only(_read_llama3, known))


def _generic_streamer(known: Known) -> ToolStreamer:
    return _WholeStreamer(None, None, _known_only(_read_generic, known))


_CONTROLS = {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\x00": "\\x00"}  # raw in a string: escaped before parsing


class _PythonExtent:
    """Finds where the Python list that opens at `start` closes, reading the text as it grows: brackets of the three
    kinds, and strings in either quote, single or triple (one or two quotes at the text's end wait for what follows:
    they may open or close a triple-quoted string); the scan resumes where it stopped. It notes the raw control
    characters inside strings, which models write (a line break in a one-line string) and Python refuses."""

    def __init__(self, start: int) -> None:
        self.start = start
        self._pos = start
        self._depth = 0
        self._quote: str | None = None  # what closes the open string: ' " ''' or """
        self._escaped = False
        self._controls: list[int] = []  # where the raw control characters inside strings are

    def end(self, text: str) -> int | None:
        """The index just past the closing bracket, or None while it has not come."""
        i = self._pos
        while i < len(text):
            char = text[i]
            if self._quote is not None:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif text.startswith(self._quote, i):
                    i += len(self._quote)
                    self._quote = None
                    continue
                elif self._quote.startswith(text[i:]):  # the text ends in what may close a triple quote
                    break
                elif char in _CONTROLS:
                    self._controls.append(i)
            elif char in "'\"":
                if len(text) - i < 3 and text[i:] == char * (len(text) - i):
                    break
                self._quote = char * 3 if text.startswith(char * 3, i) else char
                i += len(self._quote)
                continue
            elif char in "([{":
                self._depth += 1
            elif char in ")]}":
                self._depth -= 1
                if self._depth == 0:
                    return i + 1
            i += 1
        self._pos = i
        return None

    def source(self, text: str, end: int) -> str:
        """text[start:end], the list, with the control characters inside its strings escaped."""
        pieces, pos = [], self.start
        for i in self._controls:
            pieces += [text[pos:i], _CONTROLS[text[i]]]
            pos = i + 1
        return "".join(pieces) + text[pos:end]


_JSON_NAMES = {"true": True, "false": False, "null": None}  # JSON's literals, which models write in Python too


def _json_value(node: ast.expr) -> Any:
    """The JSON value of a literal argument, as vLLM's pythonic parser reads one: constants, lists (and tuples and
    sets, as lists), dicts with constant keys, f-strings without placeholders, true/false/null, signed numbers.
    Raises ValueError for anything else."""
    if isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, (str, int, float))):
        return node.value
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        return [_json_value(item) for item in node.elts]
    if isinstance(node, ast.Dict) and all(isinstance(key, ast.Constant) for key in node.keys):  # None: **mapping
        return {key.value: _json_value(value) for key, value in zip(node.keys, node.values)}  # type: ignore[union-attr]
    if isinstance(node, ast.JoinedStr) and all(isinstance(part, ast.Constant) for part in node.values):
        return "".join(str(part.value) for part in node.values)  # type: ignore[attr-defined]
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        number = _json_value(node.operand)
        if isinstance(number, (int, float)) and not isinstance(number, bool):
            return -number if isinstance(node.op, ast.USub) else number
    raise ValueError("not a literal")


def _dotted_name(node: ast.expr) -> str | None:
    """`f` or `a.b.f` of a call's target, None for anything else."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else None


def _read_pythonic(text: str) -> list[ToolCall] | None:
    """The calls of a Python list of `name(keyword=literal, ...)` (a dotted name kept whole), each call's arguments
    re-serialized as JSON; None where the text is anything else (no calls, a positional argument, a keyword given
    twice, a value no literal or none JSON can hold)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # an invalid escape in a string ('\d') warns; it reads as Python reads it
        try:
            tree = ast.parse(text, mode="eval")
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return None
    calls = []
    for node in tree.body.elts:
        name = _dotted_name(node.func) if isinstance(node, ast.Call) else None
        if name is None or node.args:  # type: ignore[attr-defined]
            return None
        arguments: dict[str, Any] = {}
        for keyword in node.keywords:  # type: ignore[attr-defined]
            if keyword.arg is None or keyword.arg in arguments:  # **mapping, or a keyword given twice
                return None
            try:
                arguments[keyword.arg] = _json_value(keyword.value)
            except (ValueError, RecursionError):
                return None
        try:
            calls.append(ToolCall(name, json.dumps(arguments, ensure_ascii=False, allow_nan=False)))
        except (TypeError, ValueError, RecursionError):  # a key JSON cannot hold, an infinite number, a huge int
            return None
    return calls


# a list of calls opens so: `[`, then a name and its `(` (more text must come before the output is known not to be)
_PYTHONIC_OPENING = re.compile(r"\[\s*(?:[^\W\d][\w.]*\s*(\()?)?")


class _PythonicStreamer(_HeldStreamer):
    """The output opens with a Python list of calls (after optional whitespace) or it is content, as the other
    whole-output formats: the text is held back while it may still be calls (up to the first name's `(`, then to
    the list's end); once the list has closed, its calls are sent when text follows it (that text, from the list's
    end, is content, and the rest passes through) or at the end (whitespace after them dropped); anything else
    releases all of the text as content."""

    def __init__(self, read: Callable[[str], list[ToolCall] | None]) -> None:
        self._read = read
        self._text = ""
        self._pos = 0  # the leading whitespace read so far
        self._list: _PythonExtent | None = None
        self._end: int | None = None  # just past the list, once it has closed
        self._content = False  # decided: the rest of the output is content

    def _advance(self, final: bool) -> list[Piece]:
        if self._list is None:
            self._pos = _skip_space(self._text, self._pos)
            opening = _PYTHONIC_OPENING.match(self._text, self._pos)
            if opening is None or opening.group(1) is None:  # no `[`, or not (yet) a name and its `(`
                undecided = self._pos == len(self._text) or (opening is not None and opening.end() == len(self._text))
                return [] if undecided and not final else self._release()
            self._list = _PythonExtent(self._pos)
        if self._end is None:
            self._end = self._list.end(self._text)
            if self._end is None:
                return self._release() if final else []
        text_after = _skip_space(self._text, self._end) < len(self._text)
        if not (text_after or final):
            return []
        calls = self._read(self._list.source(self._text, self._end))
        if calls is None:
            return self._release()
        self._content = True  # the calls, then any text after them as content, passed through from here on
        deltas = [ToolCallDelta(i, call.name, call.arguments) for i, call in enumerate(calls)]
        return _settled(*deltas, self._text[self._end :] if text_after else "")

    def _release(self) -> list[Piece]:
        """Everything so far is content (nothing was sent before), and so is the rest."""
        self._content = True
        return _settled(self._text)


def _pythonic_streamer(known: Known) -> ToolStreamer:
    return _PythonicStreamer(_known_only(_read_pythonic, known))


# ---- calls a grammar holds ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HeldLayout:
    """How the grammar that holds a format's calls writes them (tags.py; its JSON compact, one space after ':' and
    ','): a call is one of `heads`, its name as a JSON string, `key`, its arguments object and one of `tails`;
    `opening` comes before the first call, `separator` between two, `closing` after the last. With `text_around`
    (hermes) each call stands alone in free text; else the calls are the whole output, or the output is text that
    opens no JSON object."""

    heads: tuple[str, ...]
    key: str
    tails: tuple[str, ...]
    opening: str = ""
    separator: str = ""
    closing: str = ""
    text_around: bool = False


HERMES_LAYOUT = HeldLayout(
    heads=(HERMES_START + '\n{"name": ', HERMES_START + '{"name": '),  # the two spellings a Hermes-style model writes
    key=', "arguments": ',
    tails=("}\n" + HERMES_END, "}" + HERMES_END),
    text_around=True,
)
LLAMA3_LAYOUT = HeldLayout(heads=('{"name": ',), key=', "parameters": ', tails=("}",), separator="; ")
GENERIC_LAYOUT = HeldLayout(
    heads=('{"name": ',), key=', "arguments": ', tails=("}",), opening='{"tool_calls": [', separator=", ", closing="]}"
)

_CALL_NAME = object()  # in a _match pattern: the call's name, a JSON string
_NAME_LIMIT = 66  # the longest such string of a function name (OpenAI's: 64 of [A-Za-z0-9_.-]) and its quotes
_WAIT, _FAIL = "wait", "fail"  # _match's verdicts where it finds no match: more text may give one; none can


def _match(text: str, pos: int, pattern: list[Any]) -> tuple[str | None, int] | str:
    """Matches at `pos` a pattern of parts, each a tuple of texts (one of them) or _CALL_NAME: (the name, where the
    match ends), or _WAIT while the text is a proper prefix of a match, or _FAIL. Every text's alternatives are
    such that none is a prefix of another, so the first that matches is the one."""
    name = None
    for part in pattern:
        if part is _CALL_NAME:
            if not text.startswith('"', pos):
                return _WAIT if pos == len(text) else _FAIL
            end = _string_end(text[: pos + _NAME_LIMIT], pos)
            if end is None:  # a name's string is short: a longer one is no call's (nor rescanned as it grows)
                return _WAIT if len(text) < pos + _NAME_LIMIT else _FAIL
            name = _loads(text[pos:end])
            if not isinstance(name, str):
                return _FAIL
            pos = end
            continue
        found = next((alt for alt in part if text.startswith(alt, pos)), None)
        if found is None:
            return _WAIT if any(alt.startswith(text[pos:]) for alt in part) else _FAIL
        pos += len(found)
    return name, pos


def _string_end(text: str, start: int) -> int | None:
    """The index just past the JSON string that opens at `start`, or None while it has not closed."""
    pos = start + 1
    while pos < len(text):
        if text[pos] == "\\":
            pos += 2
        elif text[pos] == '"':
            return pos + 1
        else:
            pos += 1
    return None


class _HeldCallsStreamer(ToolStreamer):
    """Calls a grammar holds (tool_choice "required" or a named function, and "auto" where a structural tag holds
    the calls): each is valid by construction, so it is sent as it is generated: its name once its head, the key
    and the arguments' opening bracket have come, then its arguments' text as it comes, the model's own. Only a
    text cut short (max_tokens, a stop string) leaves the layout: cut before a call's arguments open, the call's
    text is content; cut after, the call's arguments stop where the text did, and calls_whole() says so; cut
    after a call, in its tail, the next call's head or the closing, the cut text is dropped (not content). Text
    that does not follow the layout (which the grammar does not write) is content from where it leaves it: all
    of a whole-output format's text before its first call, a hermes marker that no call follows; and a call
    naming a tool it may not call (or a name longer than a function's) is no call (its text is content)."""

    def __init__(self, layout: HeldLayout, known: Known) -> None:
        self._layout = layout
        self._known = known
        self._marker = os.path.commonprefix(list(layout.heads))  # where a call of text_around may open
        self._text = ""
        self._pos = 0  # read up to here
        self._arguments: _JsonExtent | None = None  # the arguments being sent
        # where the text stands: "start" (whole-output: before anything), "text" (free text), "head" (at a
        # marker), "arguments", "after" (past a call's arguments), "done" (whole-output: after the closing,
        # whose text, and any text a layout left, is content)
        self._state = "text" if layout.text_around else "start"
        self._unclosed = False  # a call's arguments ended and its text then left the layout
        self._space_end = 0  # "start": where the whitespace the output opens with ends, so far
        self._out = _Output()

    def feed(self, delta: str) -> list[Piece]:
        self._text += delta
        self._advance(final=False)
        return self._out.take()

    def finish(self) -> list[Piece]:
        self._advance(final=True)
        self._out.close()
        return self._out.take()

    def calls_whole(self) -> bool:
        return self._state not in ("arguments", "after") and not self._unclosed

    def _advance(self, final: bool) -> None:
        while self._step(final):
            pass

    def _step(self, final: bool) -> bool:
        """One step from _pos; False once the text so far is read (or held back for what comes next)."""
        layout, text = self._layout, self._text
        if self._state == "done":
            self._out.text(text[self._pos :])
            self._pos = len(text)
            return False
        if self._state == "text":
            upto, marker = _next_marker(text, self._pos, (self._marker,), final)
            self._out.text(text[self._pos : upto])
            self._pos = upto
            if marker is None:
                return False
            self._state = "head"
        if self._state in ("start", "head"):
            first = self._state == "start"
            if first:  # whitespace read once (_pos stays at the start: on a miss all of it is content)
                self._space_end = _skip_space(text, self._space_end)
            pos = self._space_end if first else self._pos
            opening = [(layout.opening,)] if first else []
            head = self._call(_match(text, pos, [*opening, layout.heads, _CALL_NAME, (layout.key,), ("{",)]))
            if head == _WAIT and not final:
                return False
            if head in (_WAIT, _FAIL):  # no call: its text is content
                if first:
                    self._state = "done"
                else:
                    self._out.text(text[self._pos : self._pos + 1])
                    self._pos, self._state = self._pos + 1, "text"
                return True
            self._open(*head)
            return True
        if self._state == "arguments":
            assert self._arguments is not None
            end = self._arguments.end(text)
            upto = len(text) if end is None else end
            self._out.arguments(text[self._pos : upto])
            self._pos = upto
            if end is None:
                return False
            self._state = "after"
        # after a call's arguments: its tail, then (whole-output) the next call or the closing
        after = self._pos
        if layout.text_around:
            tail = _match(text, after, [layout.tails])
            if isinstance(tail, tuple):
                self._pos, self._state = tail[1], "text"
                return True
        else:
            following = [layout.tails, (layout.separator,), layout.heads, _CALL_NAME, (layout.key,), ("{",)]
            next_call = self._call(_match(text, after, following))
            if isinstance(next_call, tuple):
                self._open(*next_call)
                return True
            if next_call == _WAIT and not final:  # llama3_json's closing is its tail alone: a "; " may follow
                return False
            # at the end, text that may still open the next call is cut short in its head, however a closing
            # matches before it (llama3_json's: its tail alone): dropped below, as a cut tail
            cut_in_head = next_call == _WAIT
            closing = _match(text, after, [layout.tails, (layout.closing,)])
            if isinstance(closing, tuple) and not (cut_in_head and closing[1] < len(text)):
                self._pos, self._state = closing[1], "done"
                return True
            tail = _WAIT if cut_in_head else closing
        if tail == _WAIT and not final:
            return False
        if tail == _FAIL:  # the text left the layout: content from here, the call unclosed
            self._unclosed, self._state = True, "done"
            return True
        self._pos = len(text)  # cut short in a call's tail, which is dropped: the call is not whole
        return False

    def _call(self, match: tuple[str | None, int] | str) -> tuple[str | None, int] | str:
        """A head's match, _FAIL where it names a tool the request may not call."""
        return _FAIL if isinstance(match, tuple) and not self._known(match[0]) else match

    def _open(self, name: str, end: int) -> None:
        """Sends a call's first delta (its name) and starts on its arguments, whose '{' is at end - 1."""
        self._out.open_call(name)
        self._pos, self._state = end - 1, "arguments"
        self._arguments = _JsonExtent(end - 1)


HELD_PARSERS: dict[str, ToolParser] = {  # the formats whose calls a grammar can hold (tags.calls_format)
    "hermes": ToolParser("hermes", lambda known: _HeldCallsStreamer(HERMES_LAYOUT, known), keeps_special_tokens=True),
    "llama3_json": ToolParser("llama3_json", lambda known: _HeldCallsStreamer(LLAMA3_LAYOUT, known)),
    "generic": ToolParser("generic", lambda known: _HeldCallsStreamer(GENERIC_LAYOUT, known)),
}


# ---- choosing a parser ---------------------------------------------------------------------------------------------

PARSERS: dict[str, ToolParser] = {
    parser.name: parser
    for parser in (
        ToolParser("hermes", _hermes_streamer, keeps_special_tokens=True),
        ToolParser("llama3_json", _llama3_streamer),
        ToolParser("mistral", _mistral_streamer, keeps_special_tokens=True),
        ToolParser("granite", _granite_streamer, keeps_special_tokens=True),
        ToolParser("pythonic", _pythonic_streamer),
        ToolParser("generic", _generic_streamer),
    )
}


def get_parser(name: str) -> ToolParser:
    try:
        return PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of {', '.join(PARSERS)}") from None


def detect_parser(chat_template: str | None) -> str | None:
    """The parser a chat template's own tool-call markers call for, in this order of precedence: granite
    (`<|tool_call|>`), hermes (`<tool_call>`), mistral (`[TOOL_CALLS]`), llama3_json (`<|python_tag|>`, or Llama 3
    headers with "parameters"). None where the template shows no tool format (the caller then uses generic)."""
    if not chat_template:
        return None
    if GRANITE_MARKERS[0] in chat_template:
        return "granite"
    if HERMES_START in chat_template:
        return "hermes"
    if MISTRAL_MARKER in chat_template:
        return "mistral"
    if LLAMA3_PYTHON_TAG in chat_template or (
        '"parameters"' in chat_template and "<|start_header_id|>" in chat_template
    ):
        return "llama3_json"
    return None
