"""Reading log lines: every accepted shape, the numpy fast path for token ids, malformed lines."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagoda.analyze.logs import LogEntry, Malformed, in_arrival_order, parse_line, read_log

from .conftest import write_log


def parse(obj: dict | str) -> list[LogEntry] | list[Malformed]:
    text = obj if isinstance(obj, str) else json.dumps(obj)
    return parse_line(text.encode(), 7)


def only(obj: dict | str) -> LogEntry:
    [entry] = parse(obj)
    assert isinstance(entry, LogEntry), entry
    return entry


def reason(obj: dict | str | bytes) -> str:
    [entry] = parse_line(obj, 7) if isinstance(obj, bytes) else parse(obj)
    assert isinstance(entry, Malformed) and entry.line == 7, entry
    return entry.reason


def test_pagoda_log_line():
    entry = only(
        {
            "timestamp": 1700000000.5,
            "endpoint": "/v1/chat/completions",
            "request_id": "chatcmpl-1",
            "body": {"messages": [{"role": "user", "content": "hi"}]},
            "prompt_token_ids": [5, 6, 7],
            "prompt_tokens": 3,
            "cached_tokens": 2,
            "output_tokens": 2,
            "output_token_ids": [8, 9],
            "ttft_s": 0.1,
            "latency_s": 0.2,
        }
    )
    assert entry.prompt.tolist() == [5, 6, 7] and entry.prompt.dtype == np.int32
    assert entry.output_ids.tolist() == [8, 9]
    # written as it finished: it arrived its latency before its timestamp
    assert (entry.line, entry.arrival, entry.output_tokens, entry.logged_cached_tokens) == (7, 1700000000.3, 2, 2)


def test_a_bodys_cache_salt_is_the_entrys():
    """The server shares cached KV only within a cache_salt: the replay needs each request's."""
    assert only({"body": {"prompt": "hi", "cache_salt": "tenant-a"}, "prompt_token_ids": [5]}).cache_salt == "tenant-a"
    assert only({"body": {"prompt": "hi"}, "prompt_token_ids": [5]}).cache_salt is None
    assert only({"messages": [{"role": "user", "content": "hi"}], "cache_salt": "t"}).cache_salt == "t"  # a bare body


def test_a_responses_log_line_routes_on_its_inputs_text():
    """/v1/responses bodies hold `input`: a string, or items whose text a gateway matches on."""
    items = [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}, {"type": "function_call"}]
    assert only({"body": {"input": items}, "prompt_token_ids": [5]}).text == "hi"
    assert only({"body": {"input": "hello"}, "prompt_token_ids": [5]}).text == "hello"


def test_output_count_without_ids_and_ids_without_count():
    assert only({"prompt_token_ids": [1], "output_tokens": 5}).output_tokens == 5
    assert only({"prompt_token_ids": [1], "output_token_ids": [2, 3]}).output_tokens == 2
    assert only({"prompt_token_ids": [1]}).output_tokens is None


@settings(max_examples=50)
@given(
    prompt=st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=50),
    output=st.lists(st.integers(0, 2**31 - 1), max_size=10),
    compact=st.booleans(),
    output_first=st.booleans(),
)
def test_fast_path_reads_ids_as_json_does(prompt, output, compact, output_first):
    fields = [("prompt_token_ids", prompt), ("output_token_ids", output), ("cached_tokens", 0)]
    obj = dict(reversed(fields) if output_first else fields)
    text = json.dumps(obj, separators=(",", ":") if compact else None)
    entry = only(text)
    assert entry.prompt.tolist() == prompt
    assert (entry.output_ids.tolist() if entry.output_ids is not None else []) == output


def test_ids_inside_the_body_do_not_confuse_the_fast_path():
    entry = only({"body": {"prompt_token_ids": [9, 9]}, "prompt_token_ids": [1, 2, 3]})
    assert entry.prompt.tolist() == [1, 2, 3]
    entry = only({"prompt_token_ids": [1, 2, 3], "body": {"prompt_token_ids": [9, 9]}})
    assert entry.prompt.tolist() == [1, 2, 3]
    assert only({"body": {"prompt": "x", "output_token_ids": [4]}}).prompt == "x"


def test_openai_bodies_and_prompt_lines():
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert only({"model": "m", "messages": chat}).prompt.messages == tuple(chat)
    tool = {"type": "function", "function": {"name": "f"}}
    assert only({"messages": chat, "tools": [tool], "temperature": 0}).prompt.fields == {"tools": [tool]}
    assert only({"model": "m", "prompt": "Once upon"}).prompt == "Once upon"
    assert only({"prompt": [4, 5]}).prompt.tolist() == [4, 5]
    batch = parse({"prompt": ["a", "b"]})
    assert [e.prompt for e in batch] == ["a", "b"] and {e.line for e in batch} == {7}
    assert [e.prompt.tolist() for e in parse({"prompt": [[1], [2, 3]]})] == [[1], [2, 3]]
    assert only({"body": {"messages": chat}, "output_tokens": 4}).output_tokens == 4


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "a JSON list, not an object"),
        ({"model": "m"}, 'no "prompt_token_ids", "messages" or "prompt"'),
        ({"prompt_token_ids": []}, "prompt_token_ids is empty"),
        ({"prompt_token_ids": [1, 2.5]}, "prompt_token_ids must be a list of integers"),
        ({"prompt_token_ids": [1, -2]}, "outside 0..2147483647"),
        ({"prompt_token_ids": [2**31]}, "outside 0..2147483647"),
        ({"prompt_token_ids": "1 2"}, "must be a list of integers"),
        ({"prompt_token_ids": [1], "output_tokens": -1}, "output_tokens must be a non-negative integer"),
        ({"prompt_token_ids": [1], "cached_tokens": "3"}, "cached_tokens must be a non-negative integer"),
        ({"prompt_token_ids": [1], "timestamp": "noon"}, "timestamp must be a number"),
        ({"messages": []}, "messages must be a non-empty list"),
        ({"messages": ["hi"]}, "each message must be a JSON object"),
        ({"prompt": ""}, "prompt is empty"),
        ({"prompt": [True]}, "prompt must be a list of integers"),
        ({"prompt": {"text": "x"}}, "prompt must be text, token ids"),
    ],
)
def test_malformed_lines_say_why(line, expected):
    assert expected in reason(line)


def test_json_errors_point_at_the_original_line():
    line = '{"prompt_token_ids": [1, 2, 3], "cached_tokens": 0,}'
    assert reason(line) == f"not valid JSON (Expecting property name enclosed in double quotes at column {len(line)})"


def test_non_utf8_is_malformed():
    assert "not UTF-8" in reason(b'{"prompt": "\xff"}')


def test_read_log_numbers_lines_and_skips_blank_ones(tmp_path):
    path = write_log(tmp_path / "log.jsonl", [{"prompt": [1]}, "", "oops", {"prompt": [2]}, "   "])
    seen = []
    items = list(read_log(path, seen.append))
    assert [(type(i).__name__, i.line) for i in items] == [("LogEntry", 1), ("Malformed", 3), ("LogEntry", 4)]
    assert sum(seen) == path.stat().st_size


def test_arrival_order_sorts_by_timestamp_within_the_window():
    def entry(line: int, stamp: float | None) -> LogEntry:
        return LogEntry(line, np.array([line], dtype=np.int32), arrival=stamp)

    items = [entry(1, 5.0), entry(2, 3.0), Malformed(3, "bad"), entry(4, None), entry(5, 4.0), entry(6, 1.0)]
    assert [i.line for i in in_arrival_order(items)] == [3, 6, 2, 5, 1, 4]
    # A window of 2 holds back only so much: line 6 comes too late to pass lines 2 and 5.
    assert [i.line for i in in_arrival_order(items, window=2)] == [3, 2, 5, 6, 1, 4]


def test_messages_responses_and_batch_bodies_become_the_chat_the_server_renders():
    """Anthropic's system prompt, a Responses request's instructions and input, an OpenAI Batch line."""
    user = {"role": "user", "content": "hi"}
    anthropic = only({"model": "claude", "system": [{"type": "text", "text": "be brief"}], "messages": [user]})
    assert anthropic.prompt.messages == ({"role": "system", "content": "be brief"}, user)
    responses = only({"model": "m", "instructions": "be brief", "input": "hi"}).prompt.messages
    assert responses[0] == {"role": "system", "content": "be brief"} and responses[1]["content"] == "hi"
    batch = only({"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": [user]}})
    assert batch.prompt.messages == (user,)


def test_a_finished_requests_line_is_replayed_at_its_arrival():
    """Pagoda's log is written as requests finish: its timestamp less the latency is the arrival."""
    assert only({"prompt_token_ids": [1], "timestamp": 100.0, "latency_s": 2.5}).arrival == 97.5
    assert only({"prompt_token_ids": [1], "timestamp": "1970-01-01T00:01:40Z"}).arrival == 100.0


def test_a_gzipped_log_reads_as_the_plain_one(tmp_path):
    import gzip

    lines = b'{"prompt_token_ids": [1, 2]}\n{"prompt": "x"}\n'
    (tmp_path / "log.jsonl").write_bytes(lines)
    (tmp_path / "log.jsonl.gz").write_bytes(gzip.compress(lines))
    plain, packed = (
        [str(e.prompt) for e in read_log(tmp_path / name, lambda _: None)] for name in ("log.jsonl", "log.jsonl.gz")
    )
    assert plain == packed and len(plain) == 2
    raw = '{"prompt": "a\x01b"}'  # json's own message ends in "at": said once
    assert reason(raw) == "not valid JSON (Invalid control character at column 14)"
