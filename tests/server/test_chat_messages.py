"""chat.parse_messages without a server: each role and shape an agent loop sends, and each bad
input a 400 naming its field; chat_template_kwargs that would change the renderer's call."""

from __future__ import annotations

import copy
import json
import pickle

import pytest

from pagoda.entrypoints.openai.chat import checked_template_kwargs, parse_messages, with_content_parts
from pagoda.entrypoints.openai.errors import APIError
from pagoda.entrypoints.openai.protocol import ChatCompletionRequest

CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
PARSED_CALL = {"type": "function", "id": "call_1", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}


def refused(messages: list[dict]) -> APIError:
    with pytest.raises(APIError) as raised:
        parse_messages(messages)
    assert raised.value.status == 400
    return raised.value


def test_system_user_assistant_and_text_parts():
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    messages = [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": parts, "name": "ann"},
        {"role": "assistant", "content": "ok"},
    ]
    parsed = parse_messages(messages)
    assert parsed == [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "a\nb", "name": "ann"},  # vLLM keeps a name for the template
        {"role": "assistant", "content": "ok"},
    ]
    assert parsed[1]["content"].parts == ("a", "b")  # for a template that loops over content
    for copied in (copy.deepcopy(parsed[1]["content"]), pickle.loads(pickle.dumps(parsed[1]["content"]))):
        assert (copied, copied.parts) == ("a\nb", ("a", "b"))


def test_every_text_part_vllm_reads_is_text():
    """The Responses API's input_text and output_text, and an assistant's refusal (OpenAI's, in a
    conversation replayed), are text as vLLM reads them."""
    messages = [
        {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't."}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "a"}, {"type": "refusal", "refusal": "b"}]},
    ]
    assert [message["content"] for message in parse_messages(messages)] == ["Hi", "I can't.", "a\nb"]


def test_a_role_of_the_templates_own_and_no_content_pass_as_vllm_passes_them():
    """Llama 3's `ipython` tool results, the legacy `function` role: the template decides."""
    messages = [
        {"role": "user", "content": None},
        {"role": "ipython", "content": '{"temp": 21}'},
        {"role": "function", "name": "get_time", "content": "noon"},
    ]
    assert parse_messages(messages) == [
        {"role": "user", "content": ""},
        {"role": "ipython", "content": '{"temp": 21}'},
        {"role": "function", "content": "noon", "name": "get_time"},
    ]


def test_developer_is_kept_for_the_renderer():
    """render_ids makes it a system message where the template has no developer role (test_chat_render.py)."""
    assert parse_messages([{"role": "developer", "content": "Be terse."}]) == [
        {"role": "developer", "content": "Be terse."}
    ]


@pytest.mark.parametrize("content", [None, "absent", "Let me look.", [{"type": "text", "text": "Let me look."}]])
def test_assistant_tool_calls_with_or_without_content(content):
    message = {"role": "assistant", "tool_calls": [CALL]}
    if content != "absent":
        message["content"] = content
    text = "Let me look." if content not in (None, "absent") else ""
    parsed = parse_messages([message])
    assert parsed == [{"role": "assistant", "content": text, "tool_calls": [PARSED_CALL]}]
    parts = [{"type": "text", "text": text}] if text else []  # vLLM's "openai" format: no content, no part
    assert with_content_parts(parsed) == [{**parsed[0], "content": parts}]


def test_tool_results_answer_earlier_calls():
    second = {**CALL, "id": "call_2", "function": {"name": "get_time", "arguments": "{}"}}
    messages = [
        {"role": "user", "content": "Weather and time in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL, second]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
        {"role": "tool", "tool_call_id": "call_2", "name": "get_time", "content": [{"type": "text", "text": "noon"}]},
    ]
    parsed = parse_messages(messages)
    assert parsed[1]["tool_calls"][1]["function"]["arguments"] == {}
    assert parsed[2:] == [
        {"role": "tool", "content": '{"temp": 21}', "tool_call_id": "call_1"},
        {"role": "tool", "content": "noon", "tool_call_id": "call_2", "name": "get_time"},
    ]


def test_a_result_whose_call_a_trimmed_history_dropped_is_taken():
    """As vLLM takes it (LangChain's trim_messages and memory buffers can cut the calling turn)."""
    parsed = parse_messages([{"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "c9", "content": "x"}])
    assert parsed[1] == {"role": "tool", "content": "x", "tool_call_id": "c9"}


def test_type_may_be_left_out_of_a_call():
    call = {key: value for key, value in CALL.items() if key != "type"}
    assert parse_messages([{"role": "assistant", "tool_calls": [call]}])[0]["tool_calls"] == [PARSED_CALL]


def _with_call(function: object = None, **changes) -> list[dict]:
    """One assistant message calling CALL, with `function` fields (or the whole function) and call fields changed."""
    function = {**CALL["function"], **(function or {})} if isinstance(function, dict | None) else function
    call = {**CALL, "function": function, **changes}
    return [{"role": "assistant", "content": None, "tool_calls": [call]}]


@pytest.mark.parametrize(
    "messages, param",
    [
        ([{"role": "", "content": "hi"}], "messages[0].role"),
        ([{"content": "hi"}], "messages[0].role"),
        ([{"role": 7, "content": "hi"}], "messages[0].role"),
        ([{"role": "user", "content": "hi", "name": ["ann"]}], "messages[0].name"),
        ([{"role": "user", "content": {"text": "hi"}}], "messages[0].content"),
        ([{"role": "assistant", "content": 5}], "messages[0].content"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "messages[0].content[0].type"),
        ([{"role": "assistant", "content": [{"type": "refusal", "text": "no"}]}], "messages[0].content[0].refusal"),
        ([{"role": "tool", "content": "x"}], "messages[0].tool_call_id"),
        ([{"role": "tool", "content": "x", "tool_call_id": 7}], "messages[0].tool_call_id"),
        ([*_with_call(), {"role": "tool", "tool_call_id": "call_1", "content": "x", "name": 3}], "messages[1].name"),
        ([{"role": "assistant", "tool_calls": {"id": "call_1"}}], "messages[0].tool_calls"),
        ([{"role": "assistant", "tool_calls": ["call_1"]}], "messages[0].tool_calls[0]"),
        (_with_call(id=None), "messages[0].tool_calls[0].id"),
        (_with_call(id=""), "messages[0].tool_calls[0].id"),
        (_with_call(type="code_interpreter"), "messages[0].tool_calls[0].type"),
        (_with_call(function="get_weather"), "messages[0].tool_calls[0].function"),
        (_with_call(function={"name": None}), "messages[0].tool_calls[0].function.name"),
        (_with_call(function={"name": ""}), "messages[0].tool_calls[0].function.name"),
    ],
)
def test_bad_messages_are_400_naming_the_field(messages, param):
    assert refused(messages).param == param


@pytest.mark.parametrize(
    "arguments, rendered",
    [
        ({"city": "Paris"}, {"city": "Paris"}),
        (None, {}),
        ("", {}),
        ('{"city": ', {}),  # a call cut short by max_tokens, as the server returns it
        ('["Paris"]', {}),
        ("[" * 100_000, {}),
        ("noon", {}),
    ],
)
def test_arguments_that_are_no_json_object_render_as_none(arguments, rendered):
    """vLLM's rule: a call's arguments stay in every later turn's history, so a malformed one (a
    cut call this server returned) becomes {} rather than refusing the turn."""
    parsed = parse_messages(_with_call(function={"name": "get_weather", "arguments": arguments}))
    assert parsed[0]["tool_calls"][0]["function"]["arguments"] == rendered


def test_arguments_keep_their_json_values():
    arguments = {"n": 3, "flags": [True, None], "nested": {"x": 1.5}}
    parsed = parse_messages(_with_call(function={"arguments": json.dumps(arguments)}))
    assert parsed[0]["tool_calls"][0]["function"]["arguments"] == arguments


class _Tokenizer:
    def apply_chat_template(  # transformers' arguments, as far as the check reads them
        self, conversation, tools=None, chat_template=None, add_generation_prompt=False, tokenize=True, **kwargs
    ): ...


def _chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], **fields)


def test_template_kwargs_pass_unless_they_name_the_renderers_arguments():
    turn = {"add_generation_prompt": True, "continue_final_message": False}  # vLLM's defaults
    assert checked_template_kwargs(_Tokenizer(), _chat(chat_template_kwargs={"enable_thinking": False})) == {
        "enable_thinking": False,
        **turn,
    }
    assert checked_template_kwargs(_Tokenizer(), _chat()) == turn
    for name in ("tokenize", "chat_template", "tools", "messages", "add_generation_prompt"):
        with pytest.raises(APIError) as raised:
            checked_template_kwargs(_Tokenizer(), _chat(chat_template_kwargs={name: True}))
        assert raised.value.param == f"chat_template_kwargs.{name}"
    continued = _chat(add_generation_prompt=False, continue_final_message=True)
    assert checked_template_kwargs(_Tokenizer(), continued) == {
        "add_generation_prompt": False,
        "continue_final_message": True,
    }
    with pytest.raises(APIError) as raised:
        checked_template_kwargs(_Tokenizer(), _chat(continue_final_message=True))
    assert raised.value.param == "continue_final_message"
