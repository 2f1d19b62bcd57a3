"""/v1/chat/completions through the official openai client, and the exact SSE shape over raw HTTP."""

from __future__ import annotations

import asyncio

import pytest

from pagoda import __version__
from tests.server.helpers import MODEL, sse_events

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a fruit."}]
GREEDY = {"temperature": 0.0, "max_tokens": 6}


@pytest.fixture(scope="module")
def greedy(client) -> str:
    return client.chat.completions.create(model=MODEL, messages=MESSAGES, **GREEDY).choices[0].message.content


def test_chat_message_usage_and_finish(client, http, greedy):
    result = client.chat.completions.create(model=MODEL, messages=MESSAGES, **GREEDY)
    choice = result.choices[0]
    assert result.object == "chat.completion" and result.id.startswith("chatcmpl-") and result.model == MODEL
    assert choice.message.role == "assistant" and choice.message.content == greedy and greedy.strip()
    assert choice.finish_reason == "length" and choice.logprobs is None
    templated = http.post("/tokenize", json={"messages": MESSAGES}).json()
    assert result.usage.prompt_tokens == templated["count"] and result.usage.completion_tokens == 6
    assert result.usage.prompt_tokens_details.cached_tokens >= 0


def test_max_completion_tokens_and_text_parts(client, greedy):
    parts = [MESSAGES[0], {"role": "user", "content": [{"type": "text", "text": "Name a fruit."}]}]
    result = client.chat.completions.create(model=MODEL, messages=parts, temperature=0.0, max_completion_tokens=6)
    assert result.choices[0].message.content == greedy and result.usage.completion_tokens == 6


def test_stream_in_openai_shape(http, greedy):
    body = {"messages": MESSAGES, "stream": True, "stream_options": {"include_usage": True}, **GREEDY}
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response.iter_lines())
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    first, *middle, last_choice, usage = chunks
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["choices"][0]["finish_reason"] is None and c["usage"] is None for c in [first, *middle])
    assert "".join(c["choices"][0]["delta"]["content"] for c in middle) == greedy
    assert last_choice["choices"][0]["delta"] == {} and last_choice["choices"][0]["finish_reason"] == "length"
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6
    assert usage["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0


def test_continuous_usage_stats_give_each_chunk_its_choice_so_far(http):
    """vLLM's stream_options.continuous_usage_stats: every chunk's usage counts its choice's tokens so far."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = {"messages": MESSAGES, "stream": True, "stream_options": options, "n": 2, **GREEDY}
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        *chunks, total = sse_events(response.iter_lines())[:-1]
    prompt = total["usage"]["prompt_tokens"]
    so_far = {0: 0, 1: 0}
    for c in chunks:
        usage, index = c["usage"], c["choices"][0]["index"]
        assert usage["prompt_tokens"] == prompt and usage["total_tokens"] == prompt + usage["completion_tokens"]
        assert usage["completion_tokens"] >= so_far[index]
        so_far[index] = usage["completion_tokens"]
    assert so_far == {0: 6, 1: 6} and total["usage"]["completion_tokens"] == 12


def test_stream_without_usage_has_no_usage_field(http):
    with http.stream("POST", "/v1/chat/completions", json={"messages": MESSAGES, "stream": True, **GREEDY}) as response:
        chunks = sse_events(response.iter_lines())[:-1]
    assert all("usage" not in c for c in chunks) and chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_logprobs_and_top_logprobs(client, greedy):
    result = client.chat.completions.create(model=MODEL, messages=MESSAGES, logprobs=True, top_logprobs=3, **GREEDY)
    content = result.choices[0].logprobs.content
    assert len(content) == 6 and "".join(entry.token for entry in content) == greedy
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].token == entry.token  # greedy: the top one
        assert entry.bytes == list(entry.token.encode()) and entry.logprob <= 0


def test_logprobs_of_a_character_split_across_tokens_join_to_it(client):
    """A token holding part of a character (its text alone ends in U+FFFD) is shown as vLLM shows
    it, read after the tokens before it: "" while the character is incomplete, the character with
    the token that completes it, so the tokens join into the answer, streamed or not. OpenAI's
    `bytes` are the token's own: its share of the character's bytes, so they join to it too."""
    answer = "🙂 é"  # the emoji takes two tokens of the default model's byte-level BPE
    kwargs = dict(
        model=MODEL,
        messages=MESSAGES,
        logprobs=True,
        top_logprobs=2,
        max_tokens=10,
        seed=3,  # the answer's tokens are sampled (the grammar allows its text in several): the same both times
        extra_body={"structured_outputs": {"choice": [answer]}},
    )
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.message.content == answer
    content = choice.logprobs.content
    tokens = [entry.token for entry in content]
    emoji = tokens.index("🙂")  # the token that completes it; the ones before it hold its first bytes
    assert emoji > 0 and tokens[:emoji] == [""] * emoji
    assert "".join(entry.token for entry in content).startswith(answer)
    joined = bytes(b for entry in content for b in entry.bytes).decode()
    assert joined.startswith(answer) and joined[len(answer) :] in ("", content[-1].token)  # then the end token
    streamed = [
        entry.token
        for chunk in client.chat.completions.create(**kwargs, stream=True)
        if chunk.choices and chunk.choices[0].logprobs
        for entry in chunk.choices[0].logprobs.content
    ]
    assert streamed == [entry.token for entry in content]


def test_n_seed_stop_and_penalties(client, greedy):
    def sample(**kwargs):
        return client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            temperature=1.0,
            max_tokens=6,
            n=2,
            seed=11,
            presence_penalty=0.5,
            frequency_penalty=0.3,
            **kwargs,
        )

    first, again = sample(), sample()
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.message.content for c in first.choices] == [c.message.content for c in again.choices]
    assert first.usage.completion_tokens == 12
    word = greedy.split()[-1]
    stopped = client.chat.completions.create(model=MODEL, messages=MESSAGES, stop=[word], **GREEDY).choices[0]
    assert stopped.finish_reason == "stop" and stopped.message.content == greedy[: greedy.index(word)]


def test_logit_bias_forces_a_token(client, http):
    token = http.post("/tokenize", json={"prompt": " kiwi", "add_special_tokens": False}).json()["tokens"][0]
    text = http.post("/detokenize", json={"tokens": [token]}).json()["prompt"]
    result = client.chat.completions.create(model=MODEL, messages=MESSAGES, logit_bias={str(token): 100}, **GREEDY)
    assert text.strip() and result.choices[0].message.content == text * 6


def test_streaming_n_choices_each_finish(client):
    texts, finishes = {0: "", 1: ""}, {}
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, n=2, stream=True, **GREEDY)
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert texts[0] == texts[1] and texts[0].strip() and finishes == {0: "length", 1: "length"}


def test_async_client_chat(aclient, greedy):
    async def run() -> list[str]:
        async with aclient() as api:

            async def streamed() -> str:
                stream = await api.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True, **GREEDY)
                return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

            async def plain() -> str:
                result = await api.chat.completions.create(model=MODEL, messages=MESSAGES, **GREEDY)
                return result.choices[0].message.content

            return list(await asyncio.gather(streamed(), plain(), streamed()))

    assert asyncio.run(run()) == [greedy] * 3


AGENT_HISTORY = [
    {"role": "developer", "content": "You are terse."},
    {"role": "user", "content": "What is the weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21, "sky": "clear"}'},
    {"role": "user", "content": "Should I take a coat?"},
]


def test_an_agent_history_renders_without_tools_in_the_request(http):
    """Earlier tool calls and results (no `tools` this turn) render as text for the default model's template."""
    response = http.post("/v1/chat/completions", json={"messages": AGENT_HISTORY, **GREEDY})
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["message"]["role"] == "assistant" and choice["message"]["content"]
    prompt = http.post("/tokenize", json={"messages": AGENT_HISTORY}).json()["tokens"]
    assert response.json()["usage"]["prompt_tokens"] == len(prompt)
    text = http.post("/detokenize", json={"tokens": prompt}).json()["prompt"]
    assert '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}' in text
    assert "Result of get_weather:" in text


def test_developer_messages_are_system_messages(http):
    system = http.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    developer = [{**MESSAGES[0], "role": "developer"}, MESSAGES[1]]
    assert http.post("/tokenize", json={"messages": developer}).json()["tokens"] == system
    response = http.post("/v1/chat/completions", json={"messages": developer, **GREEDY})
    assert response.status_code == 200 and response.json()["usage"]["prompt_tokens"] == len(system)


def test_chat_template_kwargs(http):
    body = {"messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": False}, **GREEDY}
    assert http.post("/v1/chat/completions", json=body).status_code == 200
    refused = http.post("/v1/chat/completions", json={**body, "chat_template_kwargs": {"tokenize": True}})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "chat_template_kwargs.tokenize"
    refused = http.post("/v1/chat/completions", json={**body, "chat_template_kwargs": ["enable_thinking"]})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "chat_template_kwargs"


def test_a_reply_without_a_generation_prompt_takes_the_last_messages_role(http):
    """vLLM's rule: after a generation prompt the reply is the assistant's (--response-role), else
    it continues the last message, in that message's role; whole and streamed alike."""
    for add_prompt, role in ((True, "assistant"), (False, "user")):
        body = {"messages": MESSAGES, **GREEDY, "add_generation_prompt": add_prompt}
        whole = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
        with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
            first = sse_events(response.iter_lines())[0]["choices"][0]["delta"]
        assert whole["role"] == first["role"] == role


def test_continue_final_message_continues_the_assistant_turn(http):
    """vLLM's continue_final_message (with add_generation_prompt false): the last message stays
    open and the answer is its continuation: greedy, the same tokens as a completion of the
    rendered prompt; add_generation_prompt false alone renders no assistant header."""
    opened = [*MESSAGES, {"role": "assistant", "content": "The fruit I name is"}]
    turn = {"add_generation_prompt": False, "continue_final_message": True}
    prompt = http.post("/tokenize", json={"messages": opened, **turn}).json()["tokens"]
    text = http.post("/detokenize", json={"tokens": prompt}).json()["prompt"]
    assert text.endswith("<|im_start|>assistant\nThe fruit I name is")
    chat = http.post("/v1/chat/completions", json={"messages": opened, **turn, **GREEDY}).json()
    assert chat["usage"]["prompt_tokens"] == len(prompt)
    completion = http.post("/v1/completions", json={"prompt": prompt, **GREEDY}).json()
    assert chat["choices"][0]["message"]["content"] == completion["choices"][0]["text"]
    bare = http.post("/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False}).json()["tokens"]
    header = http.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    assert header[: len(bare)] == bare and len(header) > len(bare)
    both = http.post("/v1/chat/completions", json={"messages": opened, "continue_final_message": True, **GREEDY})
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"
    # vLLM's echo: the reply starts with the continued message (whole and streamed); a user's last
    # message is not the reply's role, so nothing is echoed there
    answer = chat["choices"][0]["message"]["content"]
    echoed = {"messages": opened, **turn, **GREEDY, "echo": True}
    whole = http.post("/v1/chat/completions", json=echoed).json()["choices"][0]["message"]["content"]
    with http.stream("POST", "/v1/chat/completions", json={**echoed, "stream": True}) as response:
        chunks = sse_events(response.iter_lines())[:-1]
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert whole == streamed == "The fruit I name is" + answer
    unechoed = http.post("/v1/chat/completions", json={"messages": MESSAGES, **GREEDY, "echo": True}).json()
    plain = http.post("/v1/chat/completions", json={"messages": MESSAGES, **GREEDY}).json()
    assert unechoed["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]


def test_answers_carry_the_servers_system_fingerprint(client):
    """One fingerprint on chat and completion answers, whole and streamed (vLLM's full mode)."""
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    fingerprint = chat.system_fingerprint
    assert fingerprint.startswith(f"pagoda-{__version__}-") and len(fingerprint.rsplit("-", 1)[1]) == 8
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).system_fingerprint == fingerprint
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, stream=True
    )
    assert {chunk.system_fingerprint for chunk in stream} == {fingerprint}
