"""Tool-call parsers: what parse() finds in recorded outputs of each format, and that streaming any split of a text
gives exactly what parse() gives."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagoda.tools import (
    HELD_PARSERS,
    PARSERS,
    ParsedOutput,
    ToolCall,
    ToolCallDelta,
    detect_parser,
    get_parser,
)
from pagoda.tools.parsers import assemble, calls_of, content_of

from .cases import CASES, HELD_PIECES, PIECES

ALL_CASES = [(name, text, content, calls) for name, cases in CASES.items() for text, content, calls in cases]
CASE_IDS = [f"{name}-{i}" for name, cases in CASES.items() for i in range(len(cases))]


def split(text: str, cuts: set[int]) -> list[str]:
    bounds = [0, *sorted(cuts), len(text)]
    return [text[start:end] for start, end in zip(bounds, bounds[1:])]


def stream(parser_name: str, chunks: list[str]) -> ParsedOutput:
    """Feeds the chunks to a streamer, checks the deltas are well formed, and puts them together."""
    streamer = get_parser(parser_name).streamer()
    pieces = [piece for chunk in chunks for piece in streamer.feed(chunk)] + streamer.finish()
    assert "" not in pieces, pieces
    content, deltas = [content_of(pieces)], calls_of(pieces)
    calls: list[ToolCall] = []
    for delta in deltas:
        if delta.index == len(calls):
            assert delta.name is not None, deltas
            calls.append(ToolCall(delta.name, delta.arguments))
        else:
            assert delta.index == len(calls) - 1 and delta.name is None, deltas
            calls[-1] = ToolCall(calls[-1].name, calls[-1].arguments + delta.arguments)
    return ParsedOutput("".join(content), calls)


@pytest.mark.parametrize("name, text, content, calls", ALL_CASES, ids=CASE_IDS)
def test_parse_recorded_output(name, text, content, calls):
    parsed = get_parser(name).parse(text)
    assert parsed == ParsedOutput(content, [ToolCall(*call) for call in calls])
    for call in parsed.tool_calls:
        assert isinstance(json.loads(call.arguments), dict)


@pytest.mark.parametrize("name, text, content, calls", ALL_CASES, ids=CASE_IDS)
def test_streaming_every_two_way_and_one_char_split(name, text, content, calls):
    parsed = get_parser(name).parse(text)
    assert stream(name, list(text)) == parsed
    for cut in range(len(text) + 1):
        assert stream(name, split(text, {cut})) == parsed, cut


@pytest.mark.parametrize("name, text, content, calls", ALL_CASES, ids=CASE_IDS)
@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_streaming_any_split(name, text, content, calls, data):
    cuts = data.draw(st.sets(st.integers(0, len(text))))
    assert stream(name, split(text, cuts)) == get_parser(name).parse(text)


@pytest.mark.parametrize("name", list(PARSERS))
@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_streaming_random_text(name, data):
    """Texts strung from markers, parts of markers and JSON fragments: parse() never raises, and streams agree."""
    text = "".join(data.draw(st.lists(st.sampled_from(PIECES), max_size=12)))
    cuts = data.draw(st.sets(st.integers(0, len(text))))
    parsed = get_parser(name).parse(text)
    assert stream(name, split(text, cuts)) == parsed
    if not parsed.tool_calls:
        assert parsed.content == text


def test_long_streamed_call_is_scanned_once():
    """A call with large arguments streamed a character at a time costs one pass, not one per character."""
    arguments = {"code": "x = 1\n" * 20_000}
    for name, text in [
        ("hermes", f'<tool_call>{{"name": "run", "arguments": {json.dumps(arguments)}}}</tool_call>'),
        ("mistral", f'[TOOL_CALLS][{{"name": "run", "arguments": {json.dumps(arguments)}}}]'),
        ("generic", f'{{"tool_calls": [{{"name": "run", "arguments": {json.dumps(arguments)}}}]}}'),
        ("pythonic", f"[run(code={json.dumps(arguments['code'])})]"),
    ]:
        assert stream(name, list(text)).tool_calls == [ToolCall("run", json.dumps(arguments))]
    for parser in HELD_PARSERS.values():  # and the held layouts: a long run of whitespace, a name no call has
        for text in ("\n" * 20_000, '{"name": "' + "a" * 20_000, '{"tool_calls": [{"name": "' + "a" * 20_000):
            streamer = parser.streamer()
            pieces = [piece for char in text for piece in streamer.feed(char)] + streamer.finish()
            assert content_of(pieces) == text and not calls_of(pieces)


def test_content_streams_before_the_end():
    """Content is held back only while it may be part of a call."""
    streamer = get_parser("hermes").streamer()
    assert streamer.feed("Let me check <tool_") == ["Let me check "]
    assert streamer.feed("ca") == []
    assert streamer.feed('ll>{"name": "f"}</tool_call') == []
    assert streamer.feed(">") == [ToolCallDelta(0, "f", "{}")]
    assert streamer.finish() == []
    streamer = get_parser("llama3_json").streamer()
    assert streamer.feed(" <|python") == []
    assert streamer.feed("ic") == [" <|pythonic"]
    assert streamer.feed(" more") == [" more"]
    streamer = get_parser("generic").streamer()
    assert streamer.feed('{"answer": ') == []
    assert streamer.feed("4} ") == ['{"answer": 4} ']
    streamer = get_parser("pythonic").streamer()  # held only while it may open a list of calls
    assert streamer.feed(" [Don") == []
    assert streamer.feed("'t worry]") == [" [Don't worry]"]


def test_get_parser_names_the_choices():
    assert get_parser("hermes") is PARSERS["hermes"]
    with pytest.raises(ValueError, match="hermes, llama3_json, mistral, granite, pythonic, generic"):
        get_parser("granite4")


def test_the_example_call_the_prompt_shows_is_what_the_generic_parser_reads():
    from pagoda.tools.prompt import calls_text

    written = calls_text([{"name": "get_time", "arguments": {"zone": "UTC"}}])
    assert PARSERS["generic"].parse(written) == ParsedOutput("", [ToolCall("get_time", '{"zone": "UTC"}')])


@pytest.mark.parametrize(
    "template, expected",
    [
        ("{% for tool in tools %}<tool_call>\n{{ tool | tojson }}\n</tool_call>{% endfor %}", "hermes"),
        ("{{ '[AVAILABLE_TOOLS]' }}{{ tools | tojson }}[/AVAILABLE_TOOLS]{{ '[TOOL_CALLS]' }}", "mistral"),
        ("{%- if builtin_tools %}<|python_tag|>{% endif %}", "llama3_json"),
        ('<|start_header_id|>user<|end_header_id|>{"name": function name, "parameters": dictionary}', "llama3_json"),
        # a Llama-headed template with Hermes-style calls: the call markers decide
        ('<|start_header_id|>system<|end_header_id|>"parameters" <tool_call>', "hermes"),
        ('<|start_header_id|>user<|end_header_id|>{{ message["content"] }}<|eot_id|>', None),
        ('{"parameters": 1}', None),
        # Granite 3's marker is a token of its own; its 3.1+ models also write <tool_call> before the array
        ("{%- if message['role'] == 'assistant_tool_call' %}<|tool_call|>{{ message['content'] }}", "granite"),
        ("{% for message in messages %}<|im_start|>{{ message.role }}{% endfor %}", None),
        ("", None),
        (None, None),
    ],
)
def test_detect_parser(template, expected):
    assert detect_parser(template) == expected


def test_importing_the_parsers_leaves_torch_alone():
    code = "import sys, pagoda.tools; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


# outputs as grammars that hold calls write them (compact JSON, tags.py): the generic format as tool_choice "required"
# or a named function forces it, hermes' calls in free text and llama3_json's calls as "auto" holds them; the calls'
# arguments are the model's own text (here with brackets and end tags inside strings, escapes, unicode)
HELD = [
    (
        "generic",
        '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Pa}ris \\"x\\"", "n": [1, {"a": [2]}]}}]}',
        "",
    ),
    (
        "generic",
        '{"tool_calls": [{"name": "f", "arguments": {}}, {"name": "g", "arguments": {"s": "\u00e9\\u00e9"}}]}',
        "",
    ),
    (
        "hermes",
        'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa}ris </tool_call>"}}\n</tool_call>'
        ' And <tool_call>{"name": "f", "arguments": {}}</tool_call>\n',
        "Let me check. And ",
    ),
    (
        "hermes",
        '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
        '<tool_call>{"name": "g", "arguments": {}}</tool_call>',
        "",
    ),
    ("llama3_json", '{"name": "f", "parameters": {"a": [1, "}; {"]}}; {"name": "g", "parameters": {}}', ""),
    ("llama3_json", ' {"name": "f", "parameters": {}}', ""),
]


def _held_calls(text: str) -> list[tuple[str, str, int, int]]:
    """The calls in a held text: name, arguments as the model wrote them, and where the arguments start and end
    (found by json's raw decoder)."""
    decoder, calls = json.JSONDecoder(), []
    for key in ('"arguments": ', '"parameters": '):
        at = text.find(key)
        while at >= 0:
            name_at = text.rindex('"name": ', 0, at) + len('"name": ')
            name, _ = decoder.raw_decode(text, name_at)
            _, end = decoder.raw_decode(text, at + len(key))
            calls.append((name, text[at + len(key) : end], at + len(key), end))
            at = text.find(key, end)
    return sorted(calls, key=lambda call: call[2])


@pytest.mark.parametrize("parser_name, text, content", HELD)
def test_held_calls_stream_as_they_come(parser_name, text, content):
    """A held call's name is sent once its head, its key and the arguments' bracket have come, then its arguments a
    piece at a time as they are generated, the model's own text; every split of the text gives what parse() gives."""
    parser = HELD_PARSERS[parser_name]
    parsed = parser.parse(text)
    assert parsed == ParsedOutput(content, [ToolCall(name, arguments) for name, arguments, *_ in _held_calls(text)])
    assert all(isinstance(json.loads(call.arguments), dict) for call in parsed.tool_calls)
    for cut in range(len(text) + 1):
        streamer = parser.streamer()
        pieces = streamer.feed(text[:cut]) + streamer.feed(text[cut:]) + streamer.finish()
        assert (content_of(pieces), assemble(calls_of(pieces))) == (content, parsed.tool_calls), cut
    streamer = parser.streamer()
    deltas = [delta for char in text for delta in calls_of(streamer.feed(char))]
    firsts = [delta for delta in deltas if delta.name is not None]
    assert [(d.name, d.arguments) for d in firsts] == [(call.name, "") for call in parsed.tool_calls]
    pieces = [delta for delta in deltas if delta.name is None]
    assert len(pieces) == sum(len(call.arguments) for call in parsed.tool_calls)  # a character a piece


def test_a_held_call_cut_short():
    """Cut before a call's arguments open: its text is content, no call; cut in its arguments: the call as far as
    it came; either way, or cut after the arguments but before the call's (or the calls') closing, the calls sent
    are not whole; in a whole-output format, text cut after the first call's arguments open (in a call's tail, the
    next call's head) is dropped, not content."""
    generic = HELD_PARSERS["generic"]
    head = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Pa'
    assert generic.parse(head[:30]) == ParsedOutput(head[:30], [])
    assert generic.parse(head) == ParsedOutput("", [ToolCall("get_weather", '{"city": "Pa')], calls_whole=False)
    for name, text, _ in HELD:
        # where a call is open: from its arguments' first character to the end of its tail (hermes), of its
        # arguments and the call object's "}" (llama3_json, whose closing is that alone), or of all the calls (generic)
        calls = _held_calls(text)
        if name == "hermes":
            spans = [(start, text.index("</tool_call>", end) + len("</tool_call>")) for _, _, start, end in calls]
        elif name == "llama3_json":  # from the first call's arguments on, whole only where a call's "}" ends the text
            spans = [(calls[0][2], end + 1) for _, _, _, end in calls[-1:]]
        else:
            spans = [(calls[0][2], len(text))]
        ends = {end + 1 for *_, end in calls} if name == "llama3_json" else set()
        for cut in range(len(text) + 1):
            parsed = HELD_PARSERS[name].parse(text[:cut])
            whole = cut in ends or not any(start < cut < end for start, end in spans)
            assert parsed.calls_whole == whole, (name, cut)
            if name != "hermes" and calls[0][2] < cut < len(text):
                assert parsed.content == "", (name, cut, parsed.content)
    hermes = HELD_PARSERS["hermes"]
    cut_call = 'Hi <tool_call>{"name": "f", "arg'
    assert hermes.parse(cut_call) == ParsedOutput(cut_call, [])


def test_text_that_leaves_the_held_layout_is_content():
    """Beside an answer the request's own constraint allows, text may look like calls without being them: a
    whole-output format's text that opens no call is content from its start, and streams once it is known not to
    be a call; a hermes marker no call follows, or a call of a tool the request may not call, is text."""
    generic = HELD_PARSERS["generic"].streamer()
    assert generic.feed('{"tool') == []
    assert generic.feed('s": 1') == ['{"tools": 1']
    assert generic.feed("}") == ["}"]
    answer = '{"tool_calls": "none"}'
    assert HELD_PARSERS["generic"].parse(answer) == ParsedOutput(answer, [])
    text = 'a <tool_call>\n{"nam": 1} <tool_call>{"name": "secret", "arguments": {}}</tool_call> b'
    assert HELD_PARSERS["hermes"].parse(text, lambda name: name != "secret") == ParsedOutput(text, [])
    llama = HELD_PARSERS["llama3_json"]
    assert llama.parse('{"name": "f", "parameters": {}} then') == ParsedOutput(" then", [ToolCall("f", "{}")])
    assert llama.parse('{"name": "f", "parameters": {}}} x') == ParsedOutput("} x", [ToolCall("f", "{}")])
    unclosed = HELD_PARSERS["generic"].parse('{"tool_calls": [{"name": "f", "arguments": {}} x')  # the list not closed
    assert unclosed == ParsedOutput("} x", [ToolCall("f", "{}")], calls_whole=False)


@pytest.mark.parametrize("name", list(HELD_PARSERS))
@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_held_streaming_random_text(name, data):
    """Texts strung from the held layouts' pieces: parse() never raises, and streams agree."""
    text = "".join(data.draw(st.lists(st.sampled_from(PIECES + HELD_PIECES), max_size=12)))
    cuts = data.draw(st.sets(st.integers(0, len(text))))
    parser = HELD_PARSERS[name]
    streamer = parser.streamer()
    pieces = [piece for chunk in split(text, cuts) for piece in streamer.feed(chunk)] + streamer.finish()
    parsed = parser.parse(text)
    assert (content_of(pieces), assemble(calls_of(pieces))) == (parsed.content, parsed.tool_calls)
    if not parsed.tool_calls:
        assert parsed.content == text


@pytest.mark.parametrize(
    "parser_name, text, want",
    [
        (
            "hermes",
            'Checking.<tool_call>{"name": "f", "arguments": {}}</tool_call> Done.',
            ["Checking.", "f", " Done."],
        ),  # noqa: E501
        ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {}}] Done.', ["f", " Done."]),
        ("generic", '{"tool_calls": [{"name": "f", "arguments": {}}]} Done.', ["f", " Done."]),
        ("llama3_json", '{"name": "f", "parameters": {}} Done.', ["f", " Done."]),
        ("pythonic", "[f()] Done.", ["f", " Done."]),
    ],
)
def test_content_and_calls_come_in_the_order_of_the_text(parser_name, text, want) -> None:
    """Text after a call is settled after the call, however the text is split (a Responses answer's items
    and a stream's deltas follow the pieces' order)."""
    for cut in range(len(text) + 1):
        streamer = get_parser(parser_name).streamer()
        pieces = streamer.feed(text[:cut]) + streamer.feed(text[cut:]) + streamer.finish()
        order: list[str | ToolCallDelta] = []  # text merged across feeds, each call by its first delta
        for piece in pieces:
            if isinstance(piece, str) and order and isinstance(order[-1], str):
                order[-1] += piece
            elif isinstance(piece, str) or piece.name is not None:
                order.append(piece)
        assert [p if isinstance(p, str) else p.name for p in order] == want, (cut, pieces)
