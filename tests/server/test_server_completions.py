"""/v1/completions through the official openai client (and raw HTTP where the exact shape matters)."""

from __future__ import annotations

import asyncio

import pytest

from tests.server.helpers import MODEL, PROMPTS, sse_events

pytestmark = pytest.mark.slow

GREEDY = {"temperature": 0.0, "max_tokens": 6}


@pytest.fixture(scope="module")
def greedy(client) -> dict[str, str]:
    """Greedy 6-token continuations of two prompts, one request at a time."""
    return {p: client.completions.create(model=MODEL, prompt=p, **GREEDY).choices[0].text for p in PROMPTS[:2]}


def test_completion_text_usage_and_finish(client, greedy):
    result = client.completions.create(model=MODEL, prompt=PROMPTS[0], **GREEDY)
    choice = result.choices[0]
    assert result.object == "text_completion" and result.model == MODEL and result.id.startswith("cmpl-")
    assert choice.text == greedy[PROMPTS[0]] and choice.text.strip()
    assert choice.finish_reason == "length" and choice.index == 0
    assert result.usage.completion_tokens == 6
    assert result.usage.total_tokens == result.usage.prompt_tokens + 6
    assert result.usage.prompt_tokens_details.cached_tokens >= 0


def test_stream_matches_non_stream(client, greedy):
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=PROMPTS[1], stream=True, stream_options={"include_usage": True}, **GREEDY
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == greedy[PROMPTS[1]]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= 0
    assert all(c.usage is None for c in chunks[:-1])


def test_continuous_usage_stats_count_each_prompts_choice(client):
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(
        client.completions.create(model=MODEL, prompt=PROMPTS[:2], stream=True, stream_options=options, **GREEDY)
    )
    *streamed, total = chunks
    prompts = {c.choices[0].index: c.usage.prompt_tokens for c in streamed}
    assert sum(prompts.values()) == total.usage.prompt_tokens and len(prompts) == 2
    last = {c.choices[0].index: c.usage.completion_tokens for c in streamed}
    assert last == {0: 6, 1: 6} and total.usage.completion_tokens == 12


def test_many_prompts_and_n_are_indexed_prompt_major(client, greedy):
    result = client.completions.create(model=MODEL, prompt=PROMPTS[:2], n=2, **GREEDY)
    by_index = {c.index: c.text for c in result.choices}
    assert sorted(by_index) == [0, 1, 2, 3]
    assert by_index[0] == by_index[1] == greedy[PROMPTS[0]]
    assert by_index[2] == by_index[3] == greedy[PROMPTS[1]]
    assert result.usage.completion_tokens == 4 * 6


def test_token_id_prompts_equal_text_prompts(client, http, greedy):
    ids = [http.post("/tokenize", json={"prompt": p}).json()["tokens"] for p in PROMPTS[:2]]
    one = client.completions.create(model=MODEL, prompt=ids[0], **GREEDY)
    both = client.completions.create(model=MODEL, prompt=ids, **GREEDY)
    assert one.choices[0].text == greedy[PROMPTS[0]]
    assert [c.text for c in sorted(both.choices, key=lambda c: c.index)] == [greedy[p] for p in PROMPTS[:2]]
    assert both.usage.prompt_tokens == len(ids[0]) + len(ids[1])


def test_streamed_many_prompts_reassemble(client, greedy):
    texts = {0: "", 1: ""}
    for chunk in client.completions.create(model=MODEL, prompt=PROMPTS[:2], stream=True, **GREEDY):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == {0: greedy[PROMPTS[0]], 1: greedy[PROMPTS[1]]}


def test_echo_with_legacy_logprobs(client, greedy):
    result = client.completions.create(model=MODEL, prompt=PROMPTS[0], echo=True, logprobs=2, **GREEDY)
    choice = result.choices[0]
    lp = choice.logprobs
    assert choice.text == PROMPTS[0] + greedy[PROMPTS[0]]
    assert len(lp.tokens) == result.usage.prompt_tokens + 6
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    generated = lp.top_logprobs[-6:]
    # the sampled (greedy) token is among at most k + 1 entries, and is the most likely one
    for token, top in zip(lp.tokens[-6:], generated):
        assert 1 <= len(top) <= 3 and max(top, key=top.get) == token
    # every token, prompt or sampled, is its entry's first key, as vLLM lists it (clients read it so)
    assert all(next(iter(top)) == token for token, top in zip(lp.tokens[1:], lp.top_logprobs[1:]))


def test_stream_with_echo_and_logprobs(http):
    body = {"prompt": PROMPTS[0], "echo": True, "logprobs": 1, "stream": True, **GREEDY}
    with http.stream("POST", "/v1/completions", json=body) as response:
        events = sse_events(response.iter_lines())
    chunks = events[:-1]
    assert events[-1] == "[DONE]"
    assert chunks[0]["choices"][0]["text"] == PROMPTS[0]
    assert chunks[0]["choices"][0]["logprobs"]["token_logprobs"][0] is None
    tokens = [t for c in chunks[1:] for t in c["choices"][0]["logprobs"]["tokens"]]
    assert len(tokens) == 6
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_echo_with_max_tokens_0_scores_the_prompt(client):
    """lm-eval's and perplexity scripts' request: the prompt's logprobs, no new token."""
    scored = client.completions.create(model=MODEL, prompt=PROMPTS[2], echo=True, logprobs=1, max_tokens=0)
    choice, lp = scored.choices[0], scored.choices[0].logprobs
    assert choice.text == PROMPTS[2] and choice.finish_reason == "length"
    assert scored.usage.completion_tokens == 0 and len(lp.tokens) == scored.usage.prompt_tokens
    assert "".join(lp.tokens) == PROMPTS[2]
    assert lp.token_logprobs[0] is None and all(v <= 0 for v in lp.token_logprobs[1:])
    generated = client.completions.create(model=MODEL, prompt=PROMPTS[2], echo=True, logprobs=1, max_tokens=1)
    n = scored.usage.prompt_tokens
    assert generated.choices[0].logprobs.token_logprobs[1:n] == pytest.approx(lp.token_logprobs[1:], abs=1e-4)


def test_streamed_scoring_sends_the_prompt_only(http):
    body = {"prompt": PROMPTS[2], "echo": True, "logprobs": 0, "max_tokens": 0, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as response:
        events = sse_events(response.iter_lines())
    choices = [c["choices"][0] for c in events[:-1]]
    assert "".join(c["text"] for c in choices) == PROMPTS[2]
    assert [c["finish_reason"] for c in choices if c["finish_reason"]] == ["length"]
    assert sum(len(c["logprobs"]["tokens"]) for c in choices) == len(choices[0]["logprobs"]["tokens"])


def test_max_tokens_0_without_echo_is_refused(http):
    response = http.post("/v1/completions", json={"prompt": PROMPTS[2], "max_tokens": 0})
    assert response.status_code == 400 and response.json()["error"]["param"] == "max_tokens"


def test_stop_string_ends_the_text(client, greedy):
    full = greedy[PROMPTS[0]]
    stop = full.strip().split()[1]  # a word from the middle of the greedy continuation
    cut = client.completions.create(model=MODEL, prompt=PROMPTS[0], stop=[stop], **GREEDY).choices[0]
    assert cut.finish_reason == "stop" and cut.text == full[: full.index(stop)]
    kept = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], stop=stop, **GREEDY, extra_body={"include_stop_str_in_output": True}
    ).choices[0]
    assert kept.text == full[: full.index(stop) + len(stop)]
    assert kept.model_extra["stop_reason"] == stop


def test_seed_reproduces_a_sample(client):
    def sample(seed: int) -> str:
        return (
            client.completions.create(model=MODEL, prompt=PROMPTS[5], temperature=1.0, max_tokens=5, seed=seed)
            .choices[0]
            .text
        )

    first = sample(7)
    assert sample(7) == first
    assert any(sample(s) != first for s in (8, 9))


def test_best_of_returns_the_likeliest_samples_per_token(client):
    """OpenAI's best_of: that many samples drawn, the n with the highest log probability per token
    returned (best first); usage counts every sample's tokens. With a seed, the samples are n=4's."""
    kwargs = dict(model=MODEL, prompt=PROMPTS[5], temperature=1.0, max_tokens=8, seed=11)
    drawn = client.completions.create(**kwargs, n=4, logprobs=0)
    per_token = {c.text: sum(c.logprobs.token_logprobs) / len(c.logprobs.token_logprobs) for c in drawn.choices}
    assert len(set(per_token)) > 2  # samples that differ, so the ranking picks
    best = client.completions.create(**kwargs, n=2, best_of=4)
    assert [c.index for c in best.choices] == [0, 1] and all(c.logprobs is None for c in best.choices)
    assert [c.text for c in best.choices] == sorted(per_token, key=per_token.get, reverse=True)[:2]
    assert best.usage.completion_tokens == drawn.usage.completion_tokens


def test_vllm_sampling_extensions(client, http, greedy):
    token = http.post("/tokenize", json={"prompt": " banana", "add_special_tokens": False}).json()["tokens"][0]
    text = http.post("/detokenize", json={"tokens": [token]}).json()["prompt"]
    forced = client.completions.create(model=MODEL, prompt=PROMPTS[0], **GREEDY, logit_bias={str(token): 100}).choices[
        0
    ]
    assert text.strip() and forced.text == text * 6
    first = http.post("/tokenize", json={"prompt": greedy[PROMPTS[0]], "add_special_tokens": False}).json()["tokens"][0]
    response = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], **GREEDY, extra_body={"stop_token_ids": [first]}
    )
    stopped = response.choices[0]
    assert stopped.finish_reason == "stop" and stopped.model_extra["stop_reason"] == first
    assert stopped.text == "" and response.usage.completion_tokens == 1  # the stop token's text left out, as vLLM
    shaped = client.completions.create(
        model=MODEL,
        prompt=PROMPTS[0],
        max_tokens=4,
        temperature=0.7,
        top_p=0.9,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        extra_body={
            "top_k": 5,
            "min_p": 0.05,
            "repetition_penalty": 1.2,
            "min_tokens": 4,
            "ignore_eos": True,
            "skip_special_tokens": True,
        },
    )
    assert shaped.usage.completion_tokens == 4


def test_vllm_token_controls(client, http, greedy):
    """allowed_token_ids, bad_words and truncate_prompt_tokens are honoured, not ignored."""
    token = http.post("/tokenize", json={"prompt": " banana", "add_special_tokens": False}).json()["tokens"][0]
    text = http.post("/detokenize", json={"tokens": [token]}).json()["prompt"]
    only = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], **GREEDY, extra_body={"allowed_token_ids": [token]}
    )
    assert only.choices[0].text == text * 6
    word = greedy[PROMPTS[0]].split()[0]
    banned = client.completions.create(model=MODEL, prompt=PROMPTS[0], **GREEDY, extra_body={"bad_words": [word]})
    assert banned.choices[0].text != greedy[PROMPTS[0]]
    cut = client.completions.create(model=MODEL, prompt=PROMPTS[0], **GREEDY, extra_body={"truncate_prompt_tokens": 3})
    assert cut.usage.prompt_tokens == 3
    for body, param in (
        ({"allowed_token_ids": [10**7]}, "allowed_token_ids"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ):
        refused = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, **body})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param, refused.text


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_truncation_side_picks_the_end_kept(http, path):
    """vLLM's truncation_side: truncate_prompt_tokens keeps the prompt's last tokens ("left", the
    default) or its first ("right")."""
    chat = path.endswith("chat/completions")
    ask = {"messages": [{"role": "user", "content": PROMPTS[1]}]} if chat else {"prompt": PROMPTS[1]}
    whole = http.post("/tokenize", json={**ask, "add_special_tokens": not chat}).json()["tokens"]
    body = {**ask, **GREEDY, "return_token_ids": True, "truncate_prompt_tokens": 5}
    for side, kept in ((None, whole[-5:]), ("left", whole[-5:]), ("right", whole[:5])):
        answer = http.post(path, json={**body, "truncation_side": side}).json()
        ids = answer["prompt_token_ids"] if chat else answer["choices"][0]["prompt_token_ids"]
        assert ids == kept and answer["usage"]["prompt_tokens"] == 5, (side, answer)
    refused = http.post(path, json={**body, "truncation_side": "middle"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "truncation_side", refused.text


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_return_token_ids_streamed_and_not(http, path):
    """vLLM's return_token_ids: the prompt's ids and each choice's, whole or chunk by chunk."""
    chat = path.endswith("chat/completions")
    ask = {"messages": [{"role": "user", "content": PROMPTS[1]}]} if chat else {"prompt": PROMPTS[1]}
    body = {**ask, **GREEDY, "return_token_ids": True}
    whole = http.post(path, json=body).json()
    choice = whole["choices"][0]
    prompt_ids = whole["prompt_token_ids"] if chat else choice["prompt_token_ids"]
    tokenized = http.post("/tokenize", json={**ask, "add_special_tokens": not chat}).json()["tokens"]
    assert prompt_ids == tokenized and len(choice["token_ids"]) == whole["usage"]["completion_tokens"] == 6
    text = choice["message"]["content"] if chat else choice["text"]
    assert http.post("/detokenize", json={"tokens": choice["token_ids"]}).json()["prompt"] == text
    with http.stream("POST", path, json={**body, "stream": True}) as response:
        chunks = sse_events(response.iter_lines())[:-1]
    streamed = [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids", [])]
    firsts = [c["prompt_token_ids"] if chat else c["choices"][0]["prompt_token_ids"] for c in chunks[:1]]
    assert streamed == choice["token_ids"] and firsts == [prompt_ids]


def test_logprobs_name_tokens_by_id_where_asked(http):
    ids = {"return_token_ids": True, "return_tokens_as_token_ids": True}
    plain = http.post("/v1/completions", json={"prompt": PROMPTS[1], **GREEDY, "logprobs": 1, **ids}).json()
    choice = plain["choices"][0]
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
    texts = http.post("/v1/completions", json={"prompt": PROMPTS[1], **GREEDY, "logprobs": 1}).json()
    assert choice["logprobs"]["text_offset"] == texts["choices"][0]["logprobs"]["text_offset"]  # the text's
    assert all(set(top) >= {f"token_id:{t}"} for top, t in zip(choice["logprobs"]["top_logprobs"], choice["token_ids"]))
    messages = [{"role": "user", "content": PROMPTS[1]}]
    chat = http.post("/v1/chat/completions", json={"messages": messages, **GREEDY, "logprobs": True, **ids}).json()
    content = chat["choices"][0]["logprobs"]["content"]
    assert [entry["token"] for entry in content] == [f"token_id:{t}" for t in chat["choices"][0]["token_ids"]]


def test_prompt_logprobs_in_vllm_shape(client, http):
    ids = http.post("/tokenize", json={"prompt": PROMPTS[0]}).json()["tokens"]
    choice = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=1, extra_body={"prompt_logprobs": 1}
    ).choices[0]
    entries = choice.model_extra["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    for token_id, entry in zip(ids[1:], entries[1:]):
        assert next(iter(entry)) == str(token_id) and entry[str(token_id)]["logprob"] <= 0  # its own first
        assert 1 <= len(entry) <= 2
    assert any(len(entry) == 2 for entry in entries[1:])  # a prompt token other than the top one
    streamed = {"prompt": PROMPTS[0], "max_tokens": 1, "stream": True}
    refused = http.post("/v1/completions", json={**streamed, "prompt_logprobs": 1})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt_logprobs", refused.text
    assert http.post("/v1/completions", json={**streamed, "prompt_logprobs": 0}).status_code == 200


def test_async_client_completions(aclient, greedy):
    async def both() -> tuple[str, str]:
        async with aclient() as api:
            result = await api.completions.create(model=MODEL, prompt=PROMPTS[0], **GREEDY)
            stream = await api.completions.create(model=MODEL, prompt=PROMPTS[0], stream=True, **GREEDY)
            return result.choices[0].text, "".join([c.choices[0].text async for c in stream if c.choices])

    assert asyncio.run(both()) == (greedy[PROMPTS[0]], greedy[PROMPTS[0]])


def test_beam_search_gives_n_beams_best_first(http, client, greedy, server):
    """vLLM's use_beam_search: n beams as the n choices, each with its tokens' logprobs, ranked by
    cumulative logprob over length; one beam is greedy decoding; chat takes it too. The search has
    one log line, not one per step's request."""
    body = {"model": MODEL, "prompt": PROMPTS[0], "use_beam_search": True, **GREEDY}
    one = http.post("/v1/completions", json={**body, "n": 1}).json()
    assert one["choices"][0]["text"] == greedy[PROMPTS[0]]
    answer = http.post("/v1/completions", json={**body, "n": 3, "logprobs": 2, "ignore_eos": True}).json()
    choices = answer["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2] and len({c["text"] for c in choices}) == 3
    for top in choices[0]["logprobs"]["top_logprobs"]:  # the chosen token and logprobs=2 alternatives
        assert 2 <= len(top) <= 3, top
    prompt_tokens = answer["usage"]["prompt_tokens"]
    scores = [sum(c["logprobs"]["token_logprobs"]) / (prompt_tokens + 6) for c in choices]  # 6 tokens each
    assert all(c["finish_reason"] == "length" for c in choices) and scores == sorted(scores, reverse=True)
    assert answer["usage"]["completion_tokens"] == 18
    log = server.log()
    assert f"{answer['id']} /v1/completions: beam search of 1 prompt(s), 3 beams, 6 steps" in log
    assert f"{answer['id']}-beam0" not in log
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Name a color."}],
        n=2,
        max_tokens=5,
        extra_body={"use_beam_search": True},
    )
    assert len(chat.choices) == 2 and chat.choices[0].message.content != chat.choices[1].message.content
    streamed = ["", ""]  # a chat stream sends the finished beams, as vLLM's
    for chunk in client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Name a color."}],
        n=2,
        max_tokens=5,
        stream=True,
        extra_body={"use_beam_search": True},
    ):
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert streamed == [choice.message.content for choice in chat.choices]
