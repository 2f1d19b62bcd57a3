"""Prompts become the token ids Pagoda's server would compute for them."""

from __future__ import annotations

import numpy as np
import pytest

from pagoda.analyze.errors import AnalyzeError
from pagoda.analyze.logs import ChatPrompt
from pagoda.analyze.tokenize import ChatFlags, PromptError, PromptTokenizer


@pytest.fixture(scope="module")
def prompt_tokenizer(default_tokenizer) -> PromptTokenizer:
    return PromptTokenizer(None, tokenizer=default_tokenizer)


def test_token_ids_pass_through_without_a_tokenizer():
    tokenizer = PromptTokenizer("/no/such/model")
    ids = np.array([3, 1, 2], dtype=np.int32)
    assert tokenizer.ids(ids) is ids
    assert not tokenizer.loaded


def test_an_unknown_tokenizer_is_a_clear_error():
    with pytest.raises(AnalyzeError, match=r"Cannot load the tokenizer of /no/such/model: no such file"):
        PromptTokenizer("/no/such/model").load()


@pytest.mark.slow  # pagoda.model_files imports torch (through pagoda.config)
def test_a_file_that_is_not_a_model_is_a_clear_error(tmp_path):
    not_a_model = tmp_path / "notes.txt"
    not_a_model.write_text("hello")
    with pytest.raises(AnalyzeError, match=r"Cannot load the tokenizer of .*notes.txt: .*neither a Hugging Face"):
        PromptTokenizer(str(not_a_model)).load()


@pytest.mark.slow
def test_chat_messages_are_rendered_with_the_chat_template_as_the_server_does(prompt_tokenizer, default_tokenizer):
    from pagoda.model_files import apply_chat_template

    messages = ({"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."})
    ids = prompt_tokenizer.ids(ChatPrompt(messages))
    assert ids.tolist() == apply_chat_template(default_tokenizer, list(messages))
    text = default_tokenizer.decode(ids.tolist())
    assert text.startswith("<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nName a colour.")
    assert text.endswith("<|im_start|>assistant\n")


@pytest.mark.slow
def test_a_given_chat_template_is_used(default_tokenizer):
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    tokenizer = PromptTokenizer(None, ChatFlags(template), tokenizer=default_tokenizer)
    ids = tokenizer.ids(ChatPrompt(({"role": "user", "content": "hi"},)))
    assert ids.tolist() == default_tokenizer.encode("[user] hi\n", add_special_tokens=False)


@pytest.mark.slow
def test_completion_text_is_encoded_with_default_special_tokens(prompt_tokenizer, default_tokenizer):
    text = "Once upon a time"
    assert prompt_tokenizer.ids(text).tolist() == default_tokenizer.encode(text)


@pytest.mark.slow
def test_messages_the_template_rejects_are_this_prompts_error(default_tokenizer):
    template = "{{ raise_exception('roles must alternate') }}"
    tokenizer = PromptTokenizer(None, ChatFlags(template), tokenizer=default_tokenizer)
    with pytest.raises(PromptError, match="roles must alternate"):
        tokenizer.ids(ChatPrompt(({"role": "user", "content": "hi"},)))


@pytest.mark.slow
def test_messages_are_read_as_the_server_reads_them(prompt_tokenizer, default_tokenizer):
    from pagoda.model_files import apply_chat_template

    parts = {"role": "user", "name": "ann", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    ids = prompt_tokenizer.ids(ChatPrompt((parts,)))
    assert ids.tolist() == apply_chat_template(default_tokenizer, [{"role": "user", "content": "a\nb"}])
    with pytest.raises(PromptError, match="the server would refuse this request: messages\\[0\\].role"):
        prompt_tokenizer.ids(ChatPrompt(({"role": 7, "content": "hi"},)))


@pytest.mark.slow
def test_a_chat_requests_tools_and_template_fields_are_rendered_as_the_server_renders_them(
    prompt_tokenizer, default_tokenizer
):
    """The tools (in the generic format where the template shows none) and the template variables
    are part of the prompt the server computes: left out, a log of agent traffic is misread."""
    from pagoda.entrypoints.openai.chat import parse_messages, render_ids

    messages = ({"role": "user", "content": "Weather in Paris?"},)
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    fields = {"tools": [tool], "add_generation_prompt": False}
    ids = prompt_tokenizer.ids(ChatPrompt(messages, fields)).tolist()
    served = render_ids(
        default_tokenizer,
        parse_messages(list(messages)),
        None,
        [tool],
        {"add_generation_prompt": False, "continue_final_message": False},
    )
    assert ids == served and len(ids) > len(prompt_tokenizer.ids(ChatPrompt(messages)))
    assert "get_weather" in default_tokenizer.decode(ids)
    with pytest.raises(PromptError, match="the server would refuse this request: tools"):
        prompt_tokenizer.ids(ChatPrompt(messages, {"tools": "not a list"}))


@pytest.mark.slow
def test_the_servers_chat_flags(default_tokenizer):
    """As `pagoda serve` renders with --exclude-tools-when-tool-choice-none, --trust-request-chat-template
    and --chat-template-content-format: tool_choice "none" without its tools, a body's own template
    (refused, as the server refuses it, without the flag), content parts as the template reads them."""
    from pagoda.entrypoints.openai.chat import render_ids

    tool = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
    ask = ({"role": "user", "content": "hi"},)
    none = ChatPrompt(ask, {"tools": [tool], "tool_choice": "none"})
    shown = PromptTokenizer(None, tokenizer=default_tokenizer).ids(none).tolist()
    excluded = PromptTokenizer(None, ChatFlags(exclude_tools_when_none=True), tokenizer=default_tokenizer)
    assert excluded.ids(none).tolist() == render_ids(default_tokenizer, list(ask)) != shown
    template = "{% for m in messages %}<{{ m['content'] }}>{% endfor %}"
    own = ChatPrompt(ask, {"chat_template": template})
    with pytest.raises(PromptError, match="--trust-request-chat-template"):
        PromptTokenizer(None, tokenizer=default_tokenizer).ids(own)
    trusting = PromptTokenizer(None, ChatFlags(trust_request_template=True), tokenizer=default_tokenizer)
    assert trusting.ids(own).tolist() == default_tokenizer.encode("<hi>", add_special_tokens=False)
    parts = ChatPrompt(({"role": "user", "content": [{"type": "text", "text": "a"}]},), {"chat_template": template})
    as_sent = PromptTokenizer(
        None, ChatFlags(content_format="openai", trust_request_template=True), tokenizer=default_tokenizer
    )
    assert default_tokenizer.decode(as_sent.ids(parts).tolist()) == "<[{'type': 'text', 'text': 'a'}]>"
