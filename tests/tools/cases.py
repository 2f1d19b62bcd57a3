"""Recorded outputs of each tool-call format, with what parsing them must give: (text, content, [(name, arguments)]).

Shaped like real models' outputs (Qwen's newlines inside <tool_call>, Mistral's space after [TOOL_CALLS]), plus the
awkward ones: content around calls, two calls, malformed and unfinished calls, unicode, text that looks like the
start of a marker."""

from __future__ import annotations

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
WEATHER_CALL = ("get_weather", '{"city": "Paris", "unit": "celsius"}')
TIME = '{"name": "get_time", "arguments": {"zone": "Europe/Paris"}}'
TIME_CALL = ("get_time", '{"zone": "Europe/Paris"}')
UNICODE = '{"name": "traduire", "arguments": {"texte": "日本語 😀 \\u00e9", "vers": "français"}}'
UNICODE_CALL = ("traduire", '{"texte": "日本語 😀 é", "vers": "français"}')


NO_NAME = '{"arguments": {}}'


def hermes(body: str) -> str:
    return f"<tool_call>\n{body}\n</tool_call>"


HERMES = [
    (hermes(WEATHER), "", [WEATHER_CALL]),
    (f"I'll check the weather.\n{hermes(WEATHER)}", "I'll check the weather.\n", [WEATHER_CALL]),
    (f"{hermes(WEATHER)}\n{hermes(TIME)}", "", [WEATHER_CALL, TIME_CALL]),
    (f"\n\n{hermes(WEATHER)}\n\n{hermes(TIME)}\n", "", [WEATHER_CALL, TIME_CALL]),
    (f"Sure.{hermes(WEATHER)}Done, and {hermes(TIME)} again.", "Sure.Done, and  again.", [WEATHER_CALL, TIME_CALL]),
    (f"Voilà ! {hermes(UNICODE)}", "Voilà ! ", [UNICODE_CALL]),
    ('<tool_call>{"name":"ping","arguments":{ }}</tool_call>', "", [("ping", "{}")]),
    ('<tool_call>{"name": "ping"}</tool_call>', "", [("ping", "{}")]),  # no arguments
    (
        '<tool_call>{"name": "f", "parameters": {"x": [1, 2.5, null, true]}}</tool_call>',
        "",
        [("f", '{"x": [1, 2.5, null, true]}')],
    ),
    ("No tools needed: 2 + 2 = 4.", "No tools needed: 2 + 2 = 4.", []),
    ("   ", "   ", []),
    ("", "", []),
    # malformed calls stay in the content, raw; the good ones around them still count
    (
        '<tool_call>\n{"name": "f", "arguments": {"x": 1}\n</tool_call>',
        '<tool_call>\n{"name": "f", "arguments": {"x": 1}\n</tool_call>',
        [],
    ),
    (f"{hermes(NO_NAME)}\n{hermes(TIME)}", f"{hermes(NO_NAME)}\n", [TIME_CALL]),
    (hermes('{"name": "f", "arguments": "{\\"x\\": 1}"}'), hermes('{"name": "f", "arguments": "{\\"x\\": 1}"}'), []),
    (hermes('{"name": 7, "arguments": {}}'), hermes('{"name": 7, "arguments": {}}'), []),
    (hermes('{"name": "f", "arguments": {"x": NaN}}'), hermes('{"name": "f", "arguments": {"x": NaN}}'), []),
    (hermes("[1, 2]"), hermes("[1, 2]"), []),
    (f"{hermes(WEATHER)}\n<tool_call>\n{TIME}", f"\n<tool_call>\n{TIME}", [WEATHER_CALL]),  # unfinished
    ("<tool_call>", "<tool_call>", []),
    # text that looks like the start of a marker
    ("a <tool_ b <tool_call c </tool_call> d <", "a <tool_ b <tool_call c </tool_call> d <", []),
    ("x < y and <tool", "x < y and <tool", []),
    (f"<tool_call >{hermes(WEATHER)}<tool_call", "<tool_call ><tool_call", [WEATHER_CALL]),
]

LLAMA3 = [
    ('{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}', "", [WEATHER_CALL]),
    (f"<|python_tag|>{WEATHER}", "", [WEATHER_CALL]),
    (f"\n <|python_tag|> {WEATHER}\n", "", [WEATHER_CALL]),
    (f"{WEATHER}; {TIME}", "", [WEATHER_CALL, TIME_CALL]),
    (f"<|python_tag|>{WEATHER};{UNICODE};{TIME}", "", [WEATHER_CALL, UNICODE_CALL, TIME_CALL]),
    ('{"name": "ping"}', "", [("ping", "{}")]),
    ("The capital of France is Paris.", "The capital of France is Paris.", []),
    ("  Paris.", "  Paris.", []),
    ("", "", []),
    (" \n", " \n", []),
    # anything but calls, all through, is content; text after calls is content beside them
    ('{"answer": 4}', '{"answer": 4}', []),
    (f"{WEATHER} is what I would call.", " is what I would call.", [WEATHER_CALL]),
    (f"{WEATHER};", "", [WEATHER_CALL]),
    (f"{WEATHER}; \n", "", [WEATHER_CALL]),
    (f"{WEATHER}; Paris", " Paris", [WEATHER_CALL]),
    (f'{WEATHER}; {{"answer": 4}}', ' {"answer": 4}', [WEATHER_CALL]),
    (f'{WEATHER};{TIME}; {{"name": ', ' {"name": ', [WEATHER_CALL, TIME_CALL]),
    (f"Calling: {WEATHER}", f"Calling: {WEATHER}", []),
    ('{"name": "f", "parameters": {"x": ', '{"name": "f", "parameters": {"x": ', []),
    ('{"name": "f", "parameters": [1]}', '{"name": "f", "parameters": [1]}', []),
    ('{"name": "f", "parameters": {"s": "}{"}} ', "", [("f", '{"s": "}{"}')]),
    ('{"name": "f", "parameters": {"s": "\\"}"}}', "", [("f", '{"s": "\\"}"}')]),
    ("{not json}", "{not json}", []),
    ("<|python_tag|>print('hi')", "<|python_tag|>print('hi')", []),
    ("<|python", "<|python", []),
    ("<|pythonic|>", "<|pythonic|>", []),
    ("<", "<", []),
]

MISTRAL = [
    (f"[TOOL_CALLS] [{WEATHER}]", "", [WEATHER_CALL]),
    (f"[TOOL_CALLS][{WEATHER}, {TIME}]", "", [WEATHER_CALL, TIME_CALL]),
    (f"Let me look that up. [TOOL_CALLS] [{WEATHER}]", "Let me look that up. ", [WEATHER_CALL]),
    (f"[TOOL_CALLS] [{UNICODE}]\n\nVoilà.", "\n\nVoilà.", [UNICODE_CALL]),
    (f"[TOOL_CALLS] [{WEATHER}]\n[TOOL_CALLS] [{TIME}]\n", "", [WEATHER_CALL, TIME_CALL]),
    ('[TOOL_CALLS][{"name": "f", "arguments": {"a": "[]]"}}]', "", [("f", '{"a": "[]]"}')]),
    ("Arrays like [1, 2] and [TOOL are fine.", "Arrays like [1, 2] and [TOOL are fine.", []),
    ("Ends with [TOOL_CALL", "Ends with [TOOL_CALL", []),
    ("", "", []),
    # malformed: the marker and its array stay in the content
    ("[TOOL_CALLS] not json", "[TOOL_CALLS] not json", []),
    ("[TOOL_CALLS]", "[TOOL_CALLS]", []),
    ("[TOOL_CALLS]  ", "[TOOL_CALLS]  ", []),
    (f"[TOOL_CALLS] [{WEATHER}", f"[TOOL_CALLS] [{WEATHER}", []),
    (f'[TOOL_CALLS] [{WEATHER}, {{"name": ""}}]', f'[TOOL_CALLS] [{WEATHER}, {{"name": ""}}]', []),
    ("[TOOL_CALLS] []", "[TOOL_CALLS] []", []),
    (f"[TOOL_CALLS] {WEATHER}", f"[TOOL_CALLS] {WEATHER}", []),
    (f"[TOOL_CALLS] [TOOL_CALLS] [{TIME}]", f"[TOOL_CALLS] [TOOL_CALLS] [{TIME}]", []),  # the array is "[TOOL_CALLS]"
    (f"[TOOL_CALLS] [{{]] x [TOOL_CALLS] [{TIME}]", "[TOOL_CALLS] [{]] x ", [TIME_CALL]),
    # v11+ tokenizers' spelling: a name, an optional [ARGS], the arguments object; a marker a call
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}', "", [WEATHER_CALL]),
    ('[TOOL_CALLS]get_weather{"city": "Paris", "unit": "celsius"}', "", [WEATHER_CALL]),
    (
        'Checking. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}'
        '[TOOL_CALLS]get_time[ARGS]{"zone": "Europe/Paris"}',
        "Checking. ",
        [WEATHER_CALL, TIME_CALL],
    ),
    (
        '[TOOL_CALLS]traduire[ARGS]{"texte": "日本語 😀 \\u00e9", "vers": "français"}\n\nVoilà.',
        "\n\nVoilà.",
        [UNICODE_CALL],
    ),
    ('[TOOL_CALLS]f.v2-x[ARGS]{"s": "}{"}', "", [("f.v2-x", '{"s": "}{"}')]),
    ("[TOOL_CALLS]get_weather[ARGS]not json", "[TOOL_CALLS]get_weather[ARGS]not json", []),
    ('[TOOL_CALLS]get_weather[ARGS]{"city": ', '[TOOL_CALLS]get_weather[ARGS]{"city": ', []),
    ("[TOOL_CALLS]get_weather[ARGS][1]", "[TOOL_CALLS]get_weather[ARGS][1]", []),
    ('[TOOL_CALLS]get weather{"city": "Paris"}', '[TOOL_CALLS]get weather{"city": "Paris"}', []),
    ("[TOOL_CALLS]get_weather[AR", "[TOOL_CALLS]get_weather[AR", []),
]

GENERIC = [
    (f'{{"tool_calls": [{WEATHER}]}}', "", [WEATHER_CALL]),
    (f'\n{{"tool_calls": [{WEATHER}, {UNICODE}]}}\n', "", [WEATHER_CALL, UNICODE_CALL]),
    ('{"tool_calls":[{"name":"ping"}]}', "", [("ping", "{}")]),
    ("Paris is the capital of France.", "Paris is the capital of France.", []),
    ("", "", []),
    ('{"answer": 42}', '{"answer": 42}', []),
    ('{"tool_calls": []}', '{"tool_calls": []}', []),
    ('{"tool_calls": [{"name": "a", "arguments": "x"}]}', '{"tool_calls": [{"name": "a", "arguments": "x"}]}', []),
    (f'{{"tool_calls": [{WEATHER}]}} and then', " and then", [WEATHER_CALL]),
    (f'{{"tool_calls": [{WEATHER}]}}\n\nDone.  ', "\n\nDone.  ", [WEATHER_CALL]),
    (f'{{"tool_calls": [{WEATHER}]}}; {{"tool_calls": [{TIME}]}}', f'; {{"tool_calls": [{TIME}]}}', [WEATHER_CALL]),
    (f'Here: {{"tool_calls": [{WEATHER}]}}', f'Here: {{"tool_calls": [{WEATHER}]}}', []),
    (f'{{"tool_calls": [{WEATHER}]', f'{{"tool_calls": [{WEATHER}]', []),
    (f"<|python_tag|>{WEATHER}", f"<|python_tag|>{WEATHER}", []),
    ("[1, 2, 3]", "[1, 2, 3]", []),
]

PYTHONIC = [
    ("[get_weather(city='Paris', unit=\"celsius\")]", "", [WEATHER_CALL]),
    ('[get_weather(city="Paris", unit="celsius"), get_time(zone="Europe/Paris")]', "", [WEATHER_CALL, TIME_CALL]),
    ("\n [traduire(texte='日本語 😀 \\u00e9', vers=\"français\")]\n", "", [UNICODE_CALL]),
    ("[ping()]", "", [("ping", "{}")]),
    (
        "[f(s='a]b)', n=-3.5, l=[1, (2, 3), {'k': None}], ok=True)]",
        "",
        [("f", '{"s": "a]b)", "n": -3.5, "l": [1, [2, 3], {"k": null}], "ok": true}')],
    ),
    ("[f(s='''two\nlines ]''', t=\"it\\\"s\")]", "", [("f", '{"s": "two\\nlines ]", "t": "it\\"s"}')]),
    ("[get_time(zone='UTC')] Let me check.", " Let me check.", [("get_time", '{"zone": "UTC"}')]),
    # as vLLM's reader takes them: JSON's names, signed numbers, sets and tuples as lists, plain f-strings, dotted
    # names; raw control characters in a one-line string; a triple-quoted string with a quote inside
    (
        "[f(a=true, b=null, c=-1, d=+2.5, e=f'x', s={1}, t=(1, 2), u=False)]",
        "",
        [("f", '{"a": true, "b": null, "c": -1, "d": 2.5, "e": "x", "s": [1], "t": [1, 2], "u": false}')],
    ),
    ("[math.sqrt(x=2)]", "", [("math.sqrt", '{"x": 2}')]),
    ("[f(s='one\ntwo\tthree')]", "", [("f", '{"s": "one\\ntwo\\tthree"}')]),
    ("[run(code='''it's''')] done", " done", [("run", '{"code": "it\'s"}')]),
    ('[f(x="\\d")]', "", [("f", '{"x": "\\\\d"}')]),
    ("[get_time(zone='UTC')]\n\n", "", [("get_time", '{"zone": "UTC"}')]),
    ("The capital of France is Paris.", "The capital of France is Paris.", []),
    ("", "", []),
    (" \n", " \n", []),
    # anything but a list of calls with literal keyword arguments is content, all of it
    ("[1, 2, 3]", "[1, 2, 3]", []),
    ("[]", "[]", []),
    ("[f(1)]", "[f(1)]", []),
    ("[f(x=y)]", "[f(x=y)]", []),
    ("[f(x=10**2)]", "[f(x=10**2)]", []),
    ("[f(x=1, x=2)]", "[f(x=1, x=2)]", []),
    ("[f(**kw)]", "[f(**kw)]", []),
    ("[f(x=1e999)]", "[f(x=1e999)]", []),
    ("[f(x=-True)]", "[f(x=-True)]", []),
    ("[f(x={**a})]", "[f(x={**a})]", []),
    ("[f(x=f'{y}')]", "[f(x=f'{y}')]", []),
    ("[Don't worry] about it.", "[Don't worry] about it.", []),
    ("[a[0](x=1)]", "[a[0](x=1)]", []),
    ("[f(x=1) tail", "[f(x=1) tail", []),
    ("[f(x=a)] then text", "[f(x=a)] then text", []),
    ("Calling [get_time(zone='UTC')]", "Calling [get_time(zone='UTC')]", []),
    ("[f(s='unclosed)]", "[f(s='unclosed)]", []),
]

GRANITE = [
    (f"<|tool_call|>[{WEATHER}]", "", [WEATHER_CALL]),
    (f"<tool_call> [{WEATHER}, {TIME}]", "", [WEATHER_CALL, TIME_CALL]),
    (f"Let me check.<|tool_call|>\n[{UNICODE}]\nDone.", "Let me check.\nDone.", [UNICODE_CALL]),
    ('<|tool_call|>[{"name": "f", "arguments": {"a": "]["}}]', "", [("f", '{"a": "]["}')]),
    (f"<|tool_call|>{WEATHER}", f"<|tool_call|>{WEATHER}", []),  # an object, not the array
    (f"<|tool_call|>[{NO_NAME}]", f"<|tool_call|>[{NO_NAME}]", []),
    ("<|tool_call|>[]", "<|tool_call|>[]", []),
    ("Lists like [1, 2] stay text.", "Lists like [1, 2] stay text.", []),
    ("Ends with <|tool_", "Ends with <|tool_", []),
    ("", "", []),
]

CASES = {
    "hermes": HERMES,
    "llama3_json": LLAMA3,
    "mistral": MISTRAL,
    "granite": GRANITE,
    "pythonic": PYTHONIC,
    "generic": GENERIC,
}

# Pieces that random texts are strung from: markers, parts of markers, JSON fragments, whitespace, unicode.
PIECES = [
    "<tool_call>",
    "<|tool_call|>",
    "</tool_call>",
    "<tool_",
    "</tool",
    "[TOOL_CALLS]",
    "[TOOL",
    "<|python_tag|>",
    "<|py",
    ";",
    WEATHER,
    TIME,
    '{"tool_calls": [',
    "]}",
    "[",
    "]",
    "{",
    "}",
    '"',
    "\\",
    '"name": "f"',
    ", ",
    "\n",
    " ",
    "x",
    "é😀",
    "get_weather(city='Paris')",
    "[ARGS]",
    "[AR",
    "get_weather",
    "f(x=1)",
    "(",
    ")",
    "'",
    "'''",
    "=",
    "\n",
    "true",
]

# ... and the pieces of the layouts held calls take (parsers.HeldLayout)
HELD_PIECES = [
    '<tool_call>\n{"name": ',
    '<tool_call>{"name": ',
    "}\n</tool_call>",
    '"f"',
    '"get_weather"',
    ', "arguments": ',
    ', "parameters": ',
    '{"name": ',
    '{"tool_calls": [',
    "; ",
    '{"a": "}"}',
]
