"""chat.render_ids, the prompt a chat request becomes: a Qwen3-style template that reads `tools`
gets the tools and tool turns as they are (and chat_template_kwargs); the default model's
template, which cannot, gets them as text in the generic format."""

from __future__ import annotations

import json

import pytest

from pagoda.entrypoints.openai.chat import _template_extras, parse_messages, render_ids
from pagoda.entrypoints.openai.protocol import ChatCompletionRequest
from pagoda.model_files import load_tokenizer, resolve_model, template_iterates_content, template_supports_tools
from pagoda.tools.prompt import tool_instructions
from tests.tiny_models import write_tiny_model

pytestmark = pytest.mark.slow

# Qwen3's chat template cut down to its tool, tool-call, tool-result and thinking handling
QWEN3_STYLE_TEMPLATE = """
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
    {{- '# Tools\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
    {%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
    {{- '\\n</tools>\\n\\nFor each function call, return a json object within <tool_call></tool_call> tags.' }}
    {{- '<|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant\\n' + content }}
        {%- for tool_call in message.tool_calls or [] %}
            {%- set call = tool_call.function if tool_call.function else tool_call %}
            {%- if content or not loop.first %}{{- '\\n' }}{%- endif %}
            {{- '<tool_call>\\n{"name": "' + call.name + '", "arguments": ' + (call.arguments | tojson) }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}
"""

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
AGENT_TURNS = [
    {"role": "developer", "content": "Be terse."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21, "sky": "clear"}'},
    {"role": "user", "content": "And should I take a coat?"},
]


@pytest.fixture(scope="module")
def default_tokenizer():
    return load_tokenizer(resolve_model(None))


@pytest.fixture(scope="module")
def qwen3_tokenizer(tmp_path_factory):
    tokenizer = load_tokenizer(resolve_model(None))
    tokenizer.chat_template = QWEN3_STYLE_TEMPLATE
    path = write_tiny_model("qwen3", tmp_path_factory.mktemp("tiny") / "qwen3", tokenizer)
    return load_tokenizer(str(path))


def text_of(tokenizer, **kwargs) -> str:
    return tokenizer.decode(render_ids(tokenizer, parse_messages(AGENT_TURNS), **kwargs))


def test_which_templates_take_tools(qwen3_tokenizer, default_tokenizer):
    assert template_supports_tools(qwen3_tokenizer.chat_template)
    assert not template_supports_tools(default_tokenizer.chat_template)
    assert not template_supports_tools("{{ 'Use no tools.' }}{% for m in messages %}{{ m.content }}{% endfor %}")
    assert template_supports_tools("{% generation %}{% endgeneration %}{% if tools %}{% endif %}")  # unparsable


def test_a_template_with_tool_support_gets_tools_calls_and_results(qwen3_tokenizer):
    text = text_of(qwen3_tokenizer, tools=[WEATHER])
    assert text.startswith("<|im_start|>system\nBe terse.\n\n# Tools")
    assert json.dumps(WEATHER) in text  # the schema, through the template's own `tojson`
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    assert '<|im_start|>user\n<tool_response>\n{"temp_c": 21, "sky": "clear"}\n</tool_response><|im_end|>' in text
    assert text.endswith("<|im_start|>user\nAnd should I take a coat?<|im_end|>\n<|im_start|>assistant\n")
    assert "tool_calls" not in text  # no generic-format text on this path


def test_template_kwargs_reach_the_template(qwen3_tokenizer):
    assert "<think>" not in text_of(qwen3_tokenizer)
    thinking_off = text_of(qwen3_tokenizer, template_kwargs={"enable_thinking": False})
    assert thinking_off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert "# Tools" not in thinking_off


def test_vllm_documents_and_reasoning_effort_reach_the_template(qwen3_tokenizer):
    """vLLM's documents and reasoning_effort are template variables; reasoning_effort "none" turns
    thinking off, any other on, unless chat_template_kwargs sets enable_thinking itself."""

    def extras(**body):
        return _template_extras(ChatCompletionRequest(messages=AGENT_TURNS, **body))

    assert text_of(qwen3_tokenizer, template_kwargs=extras(reasoning_effort="none")).endswith("<think>\n\n</think>\n\n")
    assert "<think>" not in text_of(qwen3_tokenizer, template_kwargs=extras(reasoning_effort="high"))
    assert extras(reasoning_effort="none", chat_template_kwargs={"enable_thinking": True}) == {
        "reasoning_effort": "none"
    }
    assert extras() == {}
    rag = "{% for d in documents %}[{{ d.title }}: {{ d.text }}]{% endfor %}{{ reasoning_effort }}"
    docs = [{"title": "a", "text": "one"}, {"title": "b", "text": "two"}]
    kwargs = extras(documents=docs, reasoning_effort="low")
    ids = render_ids(qwen3_tokenizer, parse_messages(AGENT_TURNS), rag, template_kwargs=kwargs)
    assert qwen3_tokenizer.decode(ids) == "[a: one][b: two]low"


def test_a_template_without_tool_support_gets_them_as_text(default_tokenizer):
    text = text_of(default_tokenizer, tools=[WEATHER])
    assert text.startswith("<|im_start|>system\n" + tool_instructions([WEATHER]) + "\n\nBe terse.<|im_end|>")
    assert "- get_weather: The current weather in a city." in text
    assert json.dumps(WEATHER["function"]["parameters"]) in text
    call = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}'
    assert f"<|im_start|>assistant\n{call}<|im_end|>" in text
    result = 'Result of get_weather:\n{"temp_c": 21, "sky": "clear"}'
    assert f"<|im_start|>user\n{result}<|im_end|>" in text
    assert text.endswith("<|im_start|>user\nAnd should I take a coat?<|im_end|>\n<|im_start|>assistant\n")
    assert "None" not in text


def test_without_tools_the_history_still_renders_as_text(default_tokenizer):
    text = text_of(default_tokenizer)
    assert text.startswith("<|im_start|>system\nBe terse.<|im_end|>")
    assert '{"tool_calls": [{"name": "get_weather"' in text and "Result of get_weather:" in text


# templates that show what they were given: content as it is, or looped over as parts
AS_GIVEN = "{% for m in messages %}{{ m.role }}={{ m.content }};{% endfor %}"
LOOPS_OVER_PARTS = (
    "{% for m in messages %}{{ m.role }}:{% for part in m.content %}<{{ part.text }}>{% endfor %};{% endfor %}"
)


def rendered(tokenizer, template: str, messages: list[dict], content_format: str = "auto") -> str:
    ids = render_ids(tokenizer, parse_messages(messages), template, content_format=content_format)
    return tokenizer.decode(ids)


def test_content_reaches_a_template_that_loops_over_it_as_its_parts(default_tokenizer):
    """vLLM's content formats: auto gives a template that loops over a message's content the parts
    as sent (a string is one part), any other the text parts joined by newlines; the server's flag
    forces either. (This template reads no tools: the call comes as text in the generic format.)"""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "user", "content": "c"},
    ]
    call_text = '{"tool_calls": [{"name": "f", "arguments": {}}]}'
    assert rendered(default_tokenizer, LOOPS_OVER_PARTS, messages) == f"user:<a><b>;assistant:<{call_text}>;user:<c>;"
    assert rendered(default_tokenizer, AS_GIVEN, messages) == f"user=a\nb;assistant={call_text};user=c;"
    assert rendered(default_tokenizer, AS_GIVEN, messages[2:], "openai") == "user=[{'type': 'text', 'text': 'c'}];"
    assert rendered(default_tokenizer, LOOPS_OVER_PARTS, messages[2:], "string") == "user:<>;"  # a string's letters
    tool_result = [*messages[:2], {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "ok"}]}]
    reads_tools = AS_GIVEN + "{% if tools %}{% endif %}"
    shown = rendered(default_tokenizer, reads_tools, tool_result, "openai")
    assert shown.endswith(";assistant=[];tool=ok;"), shown  # no content no part; a tool result's a string


@pytest.mark.parametrize(
    "template, loops",
    [
        (LOOPS_OVER_PARTS, True),
        ("{% for m in messages %}{% for p in m['content'] | list %}{{ p.text }}{% endfor %}{% endfor %}", True),
        (
            "{% macro show(content) %}{% for p in content %}{{ p.text }}{% endfor %}{% endmacro %}"
            "{% for m in messages %}{{ show(m.content) }}{% endfor %}",
            True,
        ),
        ("{% for m in messages %}{% set content = m.content %}{% for c in content %}{% endfor %}{% endfor %}", True),
        (  # a tag of transformers' own: jinja2 alone cannot parse it
            "{% for message in messages %}{% generation %}{%- for item in message['content'] %}{% endfor %}"
            "{% endgeneration %}{% endfor %}",
            True,
        ),
        (AS_GIVEN, False),
        (QWEN3_STYLE_TEMPLATE, False),
        ("{% for tool in tools %}{{ tool.content }}{% endfor %}", False),
    ],
)
def test_which_templates_loop_over_content(template, loops):
    """As vLLM 0.32's detection classes each of these (checked against it once, not in the suite)."""
    assert template_iterates_content(template) is loops


def test_the_default_models_template_takes_content_as_a_string(default_tokenizer):
    assert not template_iterates_content(default_tokenizer.chat_template)


@pytest.mark.parametrize(
    "messages, shown",
    [
        ([("developer", "d"), ("user", "u")], "system=d;user=u;"),
        ([("user", "u"), ("developer", "d")], "system=d;user=u;"),  # moved first, as vLLM
        ([("system", "s"), ("user", "u"), ("developer", "d")], "system=s\n\nd;user=u;"),  # one, first
        ([("system", ""), ("developer", "d"), ("user", "u")], "system=d;user=u;"),  # empty texts dropped
        ([("user", "u"), ("system", "s")], "user=u;system=s;"),  # no developer message: left as sent
    ],
)
def test_developer_messages_become_one_first_system_message(default_tokenizer, messages, shown):
    """vLLM's rule for a template with no developer role of its own."""
    as_sent = [{"role": role, "content": text} for role, text in messages]
    assert rendered(default_tokenizer, AS_GIVEN, as_sent) == shown


def test_a_messages_name_reaches_a_template_that_reads_no_tools(default_tokenizer):
    """Such a template gets the tool turns as text (the generic format); the other messages as sent."""
    named = "{% for m in messages %}{{ m.role }}({{ m.name }})={{ m.content }};{% endfor %}"
    assert rendered(default_tokenizer, named, [{"role": "user", "content": "hi", "name": "ann"}]) == "user(ann)=hi;"


def test_a_template_with_a_developer_role_gets_developer_messages(default_tokenizer):
    template = AS_GIVEN + "{# roles: 'developer' #}"
    messages = [{"role": "user", "content": "u"}, {"role": "developer", "content": "d"}]
    assert rendered(default_tokenizer, template, messages) == "user=u;developer=d;"
