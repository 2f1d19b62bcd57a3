"""The server's pure pieces, without a server: context-length arithmetic, error params, field
refusals, logprob shapes, the request log writer, the listening socket."""

from __future__ import annotations

import json
import logging
import socket
import time

import pytest

from pagoda.entrypoints.openai.errors import APIError, param_of
from pagoda.entrypoints.openai.logprobs import (
    TokenTexts,
    before_delta,
    chat_logprobs,
    completion_logprobs,
    echo_logprobs,
    vllm_prompt_logprobs,
)
from pagoda.entrypoints.openai.params import check_context
from pagoda.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, unsupported_fields
from pagoda.entrypoints.openai.request_log import RequestLogWriter
from pagoda.entrypoints.openai.startup import bind_socket
from pagoda.request import TokenLogprob


@pytest.mark.parametrize(
    "prompt, max_tokens, refused",
    [
        (2040, 8, None),
        (2041, 8, None),  # past the context: served, the answer ending where the context does
        (2047, 100, None),
        (1, 2048, None),
        (1, 2049, "max_tokens"),  # alone more than the context: it is named
        (2047, None, None),
        (2048, None, "prompt"),  # no room for one token
        (2048, 8, "prompt"),
    ],
)
def test_the_prompt_must_leave_room_and_max_tokens_fit_the_context(prompt, max_tokens, refused):
    if refused is None:
        check_context(prompt, max_tokens, 2048, "prompt")
        return
    with pytest.raises(APIError) as raised:
        check_context(prompt, max_tokens, 2048, "prompt")
    assert raised.value.status == 400 and raised.value.param == refused
    assert "maximum context length" in raised.value.message and "2048 tokens" in raised.value.message


def test_empty_prompt_is_refused():
    with pytest.raises(APIError, match="empty"):
        check_context(0, 5, 2048, "messages")


@pytest.mark.parametrize(
    "loc, param",
    [
        (("body", "temperature"), "temperature"),
        (("body", "messages", 0, "content"), "messages[0].content"),
        (("body", "prompt", "list[int]", 3), "prompt[3]"),
        (("body", "prompt", "str"), "prompt"),
        (("body", "stream_options", "StreamOptions", "include_usage"), "stream_options.include_usage"),
        (("body",), None),
    ],
)
def test_param_of_names_the_field_the_client_sent(loc, param):
    assert param_of(loc) == param


def test_unsupported_fields():
    chat = {"messages": [{"role": "user", "content": "x"}]}
    assert unsupported_fields(ChatCompletionRequest(**chat)) is None
    assert unsupported_fields(ChatCompletionRequest(**chat, tools=[])) is None
    assert unsupported_fields(ChatCompletionRequest(**chat, tool_choice="required")) is None  # tool_calls.py checks
    assert unsupported_fields(ChatCompletionRequest(**chat, functions=[{"name": "f"}])) == "functions"
    assert unsupported_fields(ChatCompletionRequest(**chat, response_format={"type": "json_schema"})) is None
    assert unsupported_fields(CompletionRequest(prompt="x", suffix="y")) == "suffix"


class _Texts:
    def text(self, token_id: int, before=None) -> str:
        return {1: "Hel", 2: "lo", 3: " there", 4: "!"}[token_id]

    def width(self, token_id: int, before=None) -> int:
        return len(self.text(token_id))


def test_legacy_logprobs_list_the_sampled_token_among_the_top():
    lps = [TokenLogprob(3, -0.5, 1, {3: -0.5}), TokenLogprob(4, -2.0, 2, {3: -1.0})]
    result = completion_logprobs(_Texts(), lps, text_offset=5)
    assert result == {
        "tokens": [" there", "!"],
        "token_logprobs": [-0.5, -2.0],
        "top_logprobs": [{" there": -0.5}, {" there": -1.0, "!": -2.0}],
        "text_offset": [5, 11],
    }


def test_echoed_prompt_starts_without_a_logprob():
    result = echo_logprobs(_Texts(), [1, 2], [None, TokenLogprob(2, -3.0, 4, {3: -0.1})])
    assert result["tokens"] == ["Hel", "lo"] and result["token_logprobs"] == [None, -3.0]
    assert result["top_logprobs"] == [None, {" there": -0.1, "lo": -3.0}] and result["text_offset"] == [0, 3]


class _ByteTokenizer:
    """Tokens of raw bytes, decoded as a byte-level BPE decodes them: a cut character is U+FFFD."""

    PIECES = {1: b"\xf0\x9f", 2: b"\x99", 3: b"\x82", 4: b" x", 5: b"\xc3"}

    def decode(self, ids: list[int]) -> str:
        return b"".join(self.PIECES[i] for i in ids).decode(errors="replace")

    def convert_ids_to_tokens(self, token_id: int) -> bytes:
        return self.PIECES[token_id]


def test_a_character_cut_across_tokens_shows_where_it_completes():
    """vLLM's rule: a token whose text alone ends in U+FFFD is read after the tokens before it: ""
    while the character is incomplete, the whole character with the token that completes it, so the
    tokens join into the text and text_offset counts it; streamed in any chunks, the same. Each
    token's `bytes` stay its own."""
    texts, lp = TokenTexts(_ByteTokenizer()), [TokenLogprob(i, -0.1, 1, {i: -0.1, 5: -2.0}) for i in (1, 2, 3, 4)]
    whole = completion_logprobs(texts, lp, text_offset=0)
    assert whole["tokens"] == ["", "", "🙂", " x"] and whole["text_offset"] == [0, 0, 0, 1]
    assert [list(top) for top in whole["top_logprobs"]][2] == ["🙂", ""]  # an alternative read after the same tokens
    for cut in range(5):
        first = completion_logprobs(texts, lp[:cut], 0)
        rest = completion_logprobs(texts, lp[cut:], 0, before_delta(lp, lp[cut:]))
        assert first["tokens"] + rest["tokens"] == whole["tokens"], cut
        chat = (
            chat_logprobs(texts, lp[:cut], 1)["content"]
            + chat_logprobs(texts, lp[cut:], 1, before_delta(lp, lp[cut:]))["content"]
        )
        assert [entry["token"] for entry in chat] == whole["tokens"], cut
    assert [entry["bytes"] for entry in chat] == [[0xF0, 0x9F], [0x99], [0x82], [0x20, 0x78]]
    prompt = [None, *lp[1:]]  # the first prompt token has no logprob, but its bytes begin the character
    assert echo_logprobs(texts, [1, 2, 3, 4], prompt)["tokens"] == ["", "", "🙂", " x"]
    shown = [
        entry and entry[str(i)]["decoded_token"]
        for i, entry in zip((1, 2, 3, 4), vllm_prompt_logprobs(texts, [1, 2, 3, 4], prompt))
    ]
    assert shown == [None, "", "🙂", " x"]


def test_request_log_writes_json_lines(tmp_path):
    path = tmp_path / "log.jsonl"
    writer = RequestLogWriter(path)
    writer.write({"request_id": "a", "body": {"prompt": "é"}})
    writer.write({"request_id": "b"})
    writer.close()
    assert [json.loads(line)["request_id"] for line in path.read_text(encoding="utf-8").splitlines()] == ["a", "b"]


def test_request_log_failure_is_logged_once_and_never_raises(tmp_path, caplog):
    writer = RequestLogWriter(tmp_path / "missing-dir" / "log.jsonl")
    with caplog.at_level(logging.ERROR):
        for i in range(3):
            writer.write({"request_id": str(i)})
        writer.close()
    assert len([r for r in caplog.records if "request log" in r.getMessage()]) == 1


def test_metrics_have_each_finish_reason_from_the_start_and_no_created_series():
    from pagoda.core.outputs import SchedulerStats
    from pagoda.entrypoints.openai.metrics import ServerMetrics
    from tests.server.helpers import metric

    text = ServerMetrics(SchedulerStats, "m", 2048).render().decode()
    for reason in ("stop", "length", "abort"):  # at 0 before any request ends so, as vLLM's
        assert metric(text, "pagoda:request_success_total", finished_reason=reason) == 0
    assert "_created" not in text


def test_force_include_usage_gives_every_stream_its_usage_as_vllms_flag():
    from pagoda.entrypoints.openai.serving import chunk_usage

    plain = CompletionRequest(prompt="x", stream=True)
    assert chunk_usage(plain) is None  # no usage field at all
    forced = chunk_usage(plain, forced=True)
    assert forced is not None and forced(3, None) is None  # usage: null on chunks, the totals at the end
    options = {"include_usage": False, "continuous_usage_stats": True}
    continuous = chunk_usage(CompletionRequest(prompt="x", stream=True, stream_options=options), forced=True)
    assert continuous(3, None) == {"prompt_tokens": 3, "completion_tokens": 0, "total_tokens": 3}


def test_metrics_prefix_vllm_gives_vllms_own_names():
    """--metrics-prefix vllm: the names dashboards and autoscalers built for vLLM 0.32 read."""
    from pagoda.core.outputs import SchedulerStats
    from pagoda.entrypoints.openai.metrics import ServerMetrics

    metrics = ServerMetrics(lambda: SchedulerStats(num_waiting=3), "m", 2048, prefix="vllm")
    metrics.tpot.observe(0.02)
    text = metrics.render().decode()
    assert 'vllm:num_requests_waiting{model_name="m"} 3.0' in text
    for name in ("vllm:kv_cache_usage_perc", "vllm:request_success_total", "vllm:time_to_first_token_seconds_count"):
        assert name in text, name
    assert 'vllm:request_time_per_output_token_seconds_count{model_name="m"} 1.0' in text
    assert "pagoda:" not in text


def test_lora_requests_info_is_one_series_naming_the_adapters_as_vllms():
    from pagoda.core.outputs import SchedulerStats
    from pagoda.entrypoints.openai.metrics import ServerMetrics

    stats = SchedulerStats(running_lora_adapters=("a", "b"), waiting_lora_adapters=("c",))
    before = time.time()
    text = ServerMetrics(lambda: stats, "m", 2048, lambda: 3).render().decode()
    series = [line for line in text.splitlines() if line.startswith("pagoda:lora_requests_info")]
    assert len(series) == 1, series
    labels, _, value = series[0].rpartition(" ")
    assert labels == 'pagoda:lora_requests_info{max_lora="3",running_lora_adapters="a,b",waiting_lora_adapters="c"}'
    assert before <= float(value) <= time.time()  # when: a gateway reads the latest series
    assert "lora_requests_info" not in ServerMetrics(SchedulerStats, "m", 2048).render().decode()  # LoRA off


def test_accepted_connections_send_small_writes_at_once():
    """TCP_NODELAY on every connection the server accepts: without it a response's body waited
    for the client's delayed acknowledgement of its headers (40 ms on a kept-alive connection)."""
    with bind_socket("127.0.0.1", 0) as listener:
        with socket.create_connection(listener.getsockname()):
            accepted, _ = listener.accept()
            with accepted:
                assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0


def test_usage_counts_each_sequences_reasoning_tokens():
    """With a reasoning parser, usage adds completion_tokens_details.reasoning_tokens over the
    sequences (vLLM's field); without one, no details."""
    from pagoda.engine.outputs import RequestMetrics, SequenceOutput
    from pagoda.entrypoints.openai.serving import usage
    from pagoda.tools.reasoning import REASONING_PARSERS, ReasoningTokenCounter

    class Tokens:  # "<think>" and "</think>" one token each, other text a token a character
        tags = {"<think>": 1, "</think>": 2}

        def encode(self, text, add_special_tokens=False):
            return [self.tags[text]] if text in self.tags else [ord(c) for c in text]

    metrics = RequestMetrics(num_prompt_tokens=5, num_cached_tokens=0)
    outputs = [
        SequenceOutput("r", 0, text="<think>abc</think>d", token_ids=[1, 97, 98, 99, 2, 100], metrics=metrics),
        SequenceOutput("r", 1, text="xy", token_ids=[120, 121], metrics=metrics),
        SequenceOutput("r", 2, text="<think>ef", token_ids=[1, 101, 102], metrics=metrics),
    ]
    counter = ReasoningTokenCounter.of(REASONING_PARSERS["qwen3"], Tokens())
    counted = usage([outputs], counter)
    assert counted["completion_tokens"] == 11 and counted["completion_tokens_details"] == {"reasoning_tokens": 5}
    assert "completion_tokens_details" not in usage([outputs])
    # vLLM's continuous_usage_stats: every chunk counts its choice's reasoning tokens so far too
    from pagoda.entrypoints.openai.protocol import ChatCompletionRequest
    from pagoda.entrypoints.openai.serving import chunk_usage

    options = {"include_usage": True, "continuous_usage_stats": True}
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "Hi"}], stream=True, stream_options=options)
    per_chunk = chunk_usage(body, counter)
    assert per_chunk(5, None) == {
        "prompt_tokens": 5,
        "completion_tokens": 0,
        "total_tokens": 5,
        "completion_tokens_details": {"reasoning_tokens": 0},
    }
    assert [per_chunk(5, out)["completion_tokens_details"]["reasoning_tokens"] for out in outputs] == [3, 0, 2]
    assert "completion_tokens_details" not in chunk_usage(body)(5, outputs[0])


@pytest.mark.parametrize("parser, budget", [(None, None), ("qwen3", 1024)])
def test_a_messages_thinking_budget_bounds_the_thinking_where_the_server_reads_it(parser, budget):
    """Anthropic's thinking.budget_tokens is the chat request's thinking_token_budget (vLLM's mapping)
    where the server has a reasoning parser; without one the model has no thinking to bound, and the
    budget, checked, goes no further (where vLLM answers 400)."""
    from types import SimpleNamespace

    from pagoda.entrypoints.openai.messages import _Translation
    from pagoda.entrypoints.openai.protocol import AnthropicMessagesRequest
    from pagoda.entrypoints.openai.tool_calls import ToolSettings
    from pagoda.tools.reasoning import REASONING_PARSERS

    body = AnthropicMessagesRequest.model_validate(
        {
            "model": "m",
            "max_tokens": 2000,
            "messages": [{"role": "user", "content": "hi"}],
            "thinking": {"type": "enabled", "budget_tokens": 1024},
        }
    )
    state = SimpleNamespace(
        config=SimpleNamespace(tools=ToolSettings(reasoning_parser=parser)),
        reasoning=REASONING_PARSERS[parser].span if parser else None,
    )
    assert _Translation(body, state).request.thinking_token_budget == budget


def test_an_internal_error_is_a_500_that_closes_its_connection():
    """Starlette re-raises a handled exception to the server after the 500, which drops the
    connection: the response says so, so that a client does not send its next request there."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from pagoda.entrypoints.openai.errors import install_handlers

    app = FastAPI()
    install_handlers(app)

    @app.get("/boom")
    def boom() -> None:
        raise RuntimeError("a bug")

    answer = TestClient(app, raise_server_exceptions=False).get("/boom")
    assert answer.status_code == 500 and answer.headers["connection"] == "close"
    assert answer.json()["error"]["message"] == "Internal server error: RuntimeError"
