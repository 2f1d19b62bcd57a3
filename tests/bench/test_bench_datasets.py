"""Workloads: seeded generation, file parsing with clear errors, and the prefix-share arithmetic."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import pytest
from bench_helpers import write_jsonl

from pagoda.bench.datasets import (
    FollowUp,
    LengthDist,
    Prompt,
    Session,
    Workload,
    WorkloadSpec,
    load_replay,
    load_sharegpt,
    load_workload,
    next_turn,
    prefix_share,
    sessions,
    take_requests,
)
from pagoda.bench.errors import BenchError


def spec(kind: str = "random", endpoint: str = "completions", **changes: object) -> WorkloadSpec:
    base = dict(
        kind=kind,
        endpoint=endpoint,
        input_len=LengthDist.parse("32"),
        output_len=None,
        groups=2,
        prompts_per_group=3,
        system_prompt_len=40,
        question_len=8,
        turns=3,
        think_time_s=0.0,
        dataset=None,
    )
    return WorkloadSpec(**(base | changes))  # type: ignore[arg-type]


def first_prompts(workload: Workload, tokenizer, n: int, label: str = "level0", seed: int = 0) -> list[Prompt]:
    return [s.first for s in itertools.islice(sessions(workload, tokenizer, seed, label), n)]


def test_length_distributions() -> None:
    rng = random.Random(0)
    assert LengthDist.parse("7").sample(rng) == 7
    assert {LengthDist.parse("3:5").sample(rng) for _ in range(200)} == {3, 4, 5}
    normal = [LengthDist.parse("normal:100,10").sample(rng) for _ in range(2000)]
    assert 98 < sum(normal) / len(normal) < 102 and min(normal) >= 1
    for bad in ("0", "5:3", "x", "normal:1", "-2"):
        with pytest.raises(BenchError):
            LengthDist.parse(bad)


def test_random_prompts_have_the_asked_lengths_and_follow_the_seed(tokenizer) -> None:
    workload = Workload(spec(input_len=LengthDist.parse("16:64"), output_len=LengthDist.parse("5")))
    prompts = first_prompts(workload, tokenizer, 8)
    assert all(16 <= len(tokenizer.encode(p.body["prompt"])) <= 64 for p in prompts)
    assert all(
        p.body["max_tokens"] == 5 and len(p.token_ids) == len(tokenizer.encode(p.body["prompt"])) for p in prompts
    )
    assert first_prompts(workload, tokenizer, 8) == prompts  # same seed and label: same prompts
    assert first_prompts(workload, tokenizer, 8, label="level1") != prompts
    assert first_prompts(workload, tokenizer, 8, seed=1) != prompts


def test_a_random_prefix_opens_every_prompt_of_a_level(tokenizer) -> None:
    """vLLM's --random-prefix-len: the same prefix ids, then the asked number of random tokens."""
    workload = Workload(spec(input_len=LengthDist.parse("24"), prefix_len=40))
    prompts = first_prompts(workload, tokenizer, 6)
    ids = [tokenizer.encode(p.body["prompt"]) for p in prompts]
    assert all(len(i) == 64 for i in ids), [len(i) for i in ids]
    assert len({tuple(i[:38]) for i in ids}) == 1 and len({tuple(i[40:]) for i in ids}) == 6


def test_random_chat_prompts_count_the_template(tokenizer) -> None:
    prompt = first_prompts(Workload(spec(endpoint="chat")), tokenizer, 1)[0]
    assert prompt.body["messages"][0]["role"] == "user"
    assert len(prompt.token_ids) > 32  # the chat template adds its own tokens


def test_shared_prefix_groups_and_share(tokenizer) -> None:
    workload = Workload(spec("shared-prefix"))
    prompts = first_prompts(workload, tokenizer, 6)
    systems = [p.body["prompt"].split("\n")[0] for p in prompts]
    assert systems[0] == systems[2] == systems[4] != systems[1] == systems[3] == systems[5]
    shared, total = prefix_share((None, p.token_ids) for p in prompts)
    # 2 groups x 3 prompts: the 4 later prompts of the groups share the ~40-token system prompt.
    assert total == sum(len(p.token_ids) for p in prompts)
    assert 4 * 38 <= shared <= 4 * 41
    next_round = first_prompts(workload, tokenizer, 7)[6]
    assert next_round.body["prompt"].split("\n")[0] not in systems  # a new round draws new groups


def test_workloads_of_other_kinds_share_no_prompts(tokenizer) -> None:
    """A random run after a shared-prefix one on the same server (same seed) must not find its
    prompts in the prefix cache."""
    random_prompts = first_prompts(Workload(spec()), tokenizer, 6)
    grouped = first_prompts(Workload(spec("shared-prefix")), tokenizer, 6)
    shared, _ = prefix_share((None, p.token_ids) for p in random_prompts + grouped)
    alone = (
        prefix_share((None, p.token_ids) for p in grouped)[0]
        + prefix_share((None, p.token_ids) for p in random_prompts)[0]
    )
    assert shared - alone < 6 * 4  # a few tokens by chance, not a prompt's start


def test_prefix_share_exact() -> None:
    unsalted = [(None, ids) for ids in ([1, 2, 3], [1, 2, 4], [1, 2, 3, 5], [9])]
    assert prefix_share(unsalted) == (2 + 3, 11)
    assert prefix_share([]) == (0, 0)
    # a server shares cached KV only within a cache salt
    assert prefix_share([("a", [1, 2, 3]), ("b", [1, 2, 3]), (None, [1, 2, 3]), ("a", [1, 2, 4])]) == (2, 12)


def test_multi_turn_sessions_and_history(tokenizer) -> None:
    session = next(sessions(Workload(spec("multi-turn", endpoint="chat")), tokenizer, 0, "level0"))
    assert session.num_requests == 3
    second = next_turn(session.first, "reply one", session.follow_ups[0])
    roles = [m["role"] for m in second.body["messages"]]
    assert roles == ["user", "assistant", "user"] and second.body["messages"][1]["content"] == "reply one"
    completion = next_turn(Prompt("completions", {"prompt": "Q1 "}), "A1", FollowUp("Q2", 4))
    assert completion.body == {"prompt": "Q1 A1\nQ2", "max_tokens": 4}


def test_take_requests_cuts_sessions_to_the_count() -> None:
    s = Session(Prompt("chat", {}), (FollowUp("a", 1), FollowUp("b", 1)))
    taken = list(take_requests(itertools.repeat(s), 7))
    assert [t.num_requests for t in taken] == [3, 3, 1]


def test_replay_understands_every_line_format(tmp_path: Path) -> None:
    log_record = {
        "timestamp": 1.5,
        "endpoint": "/v1/chat/completions",
        "request_id": "r1",
        "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 7},
        "prompt_token_ids": [1, 2, 3],
        "prompt_tokens": 3,
        "cached_tokens": 0,
        "output_tokens": 7,
        "ttft_s": 0.1,
        "latency_s": 0.5,
    }
    path = write_jsonl(
        tmp_path / "r.jsonl",
        [
            {"model": "x", "messages": [{"role": "user", "content": "chat body"}], "max_tokens": 3},
            {"model": "x", "prompt": "completion body", "max_tokens": 4, "echo": False},
            {"prompt": "plain line", "max_tokens": 5, "temperature": 0.5},
            log_record,
            {"model": "x", "prompt": "scored", "max_tokens": 0, "echo": True, "logprobs": 1},  # lm-eval's scoring
        ],
    )
    as_completions = load_replay(path, "completions")
    assert [p.endpoint for p in as_completions] == ["chat", "completions", "completions", "chat", "completions"]
    assert as_completions[2].body == {"prompt": "plain line", "max_tokens": 5, "temperature": 0.5}
    assert as_completions[3].token_ids == (1, 2, 3) and as_completions[3].body["max_tokens"] == 7
    as_chat = load_replay(path, "chat")
    assert as_chat[2].body == {
        "messages": [{"role": "user", "content": "plain line"}],
        "max_tokens": 5,
        "temperature": 0.5,
    }
    assert as_chat[1].endpoint == "completions"  # a completions body keeps its endpoint


def test_a_request_log_replays_what_the_benchmark_sends(tmp_path: Path, capsys) -> None:
    """A Pagoda request log also holds Responses and Messages requests: skipped, with a warning;
    a max_tokens its server read laxly ("10", "+10", 10.0) is read so too; prompt_logprobs and
    best_of, which a streamed request cannot carry, are dropped (the benchmark streams)."""
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": "10", "prompt_logprobs": 1, "best_of": 2}
    records = [
        {"endpoint": "/v1/responses", "body": {"input": "hi"}},
        {"endpoint": "/v1/chat/completions", "body": chat},
        {"endpoint": "/v1/messages", "body": {"messages": []}},
        {"endpoint": "/v1/responses", "body": {"input": "again"}},
    ]
    prompts = load_replay(write_jsonl(tmp_path / "r.jsonl", records), "chat")
    assert [p.body for p in prompts] == [{"messages": chat["messages"], "max_tokens": "10"}]
    warning = capsys.readouterr().err
    assert "skipped request-log records it does not send (1 of /v1/messages, 2 of /v1/responses)" in warning
    with pytest.raises(BenchError, match="no requests in the file"):
        load_replay(write_jsonl(tmp_path / "only.jsonl", records[:1]), "chat")
    lax = [{"prompt": "a", "max_tokens": value} for value in ("+10", 10.0)]
    lax.append({"model": "x", "prompt": "a", "max_tokens": "0", "echo": True})  # scoring the prompt
    assert len(load_replay(write_jsonl(tmp_path / "lax.jsonl", lax), "completions")) == 3
    with pytest.raises(BenchError, match="'max_tokens' must be a positive integer"):  # full-width digits: refused
        load_replay(write_jsonl(tmp_path / "wide.jsonl", [{"prompt": "a", "max_tokens": "１０"}]), "completions")


@pytest.mark.parametrize(
    "lines, message",
    [
        (['{"prompt": "a"}', "{not json"], "r.jsonl:2: not valid JSON"),
        (["[1, 2]"], "r.jsonl:1: a JSON list, not an object"),
        (['{"text": "a"}'], "r.jsonl:1: expected an OpenAI request body"),
        (['{"messages": []}'], "'messages' must be a non-empty list"),
        (['{"prompt": "a", "max_tokens": -1}'], "'max_tokens' must be a positive integer"),
        (['{"prompt": "a", "max_tokens": 0}'], "'max_tokens' must be a positive integer (or 0 with echo"),
        (['{"endpoint": "/v1/embeddings", "body": {}}'], "request-log 'endpoint' must be one of"),
        (['{"endpoint": "/v1/completions", "body": {"prompt": "a"}, "prompt_token_ids": "1 2"}'], "list of integers"),
        (["", "  "], "no requests in the file"),
    ],
)
def test_malformed_replay_files_name_the_line(tmp_path: Path, lines: list[str], message: str) -> None:
    path = tmp_path / "r.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(BenchError, match=message.replace("(", r"\(").replace("[", r"\[")):
        load_replay(path, "completions")


def test_a_replay_line_that_is_not_utf8_is_named(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    path.write_bytes(b'{"prompt": "a"}\n{"prompt": "\xff"}\n')
    with pytest.raises(BenchError, match="r.jsonl:2: not UTF-8 text"):
        load_replay(path, "completions")


def test_missing_dataset_file(tmp_path: Path) -> None:
    with pytest.raises(BenchError, match="not found"):
        load_workload(spec("replay", dataset=tmp_path / "nope.jsonl"))
    with pytest.raises(BenchError, match="needs --dataset"):
        load_workload(spec("sharegpt"))


def test_sharegpt_pairs_filter_and_lengths(tmp_path: Path, tokenizer) -> None:
    long_reply = "This is a reasonably long reply with many words in it. " * 3
    data = [
        {
            "id": "a",
            "conversations": [
                {"from": "human", "value": "Tell me about lighthouses please."},
                {"from": "gpt", "value": long_reply},
            ],
        },
        {
            "id": "b",
            "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}],
        },  # too short
        {"id": "c", "conversations": [{"from": "human", "value": "only a question"}]},
    ]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))
    workload = load_workload(spec("sharegpt", dataset=path))
    assert len(workload.entries) == 2
    prompts = [s.first for s in sessions(workload, tokenizer, 0, "level0")]
    assert len(prompts) == 1 and prompts[0].body["max_tokens"] == len(tokenizer.encode(long_reply))
    path.write_text('{"conversations": 3}')
    with pytest.raises(BenchError, match="JSON list"):
        load_sharegpt(path)
    path.write_text("[{")
    with pytest.raises(BenchError, match="not valid JSON"):
        load_sharegpt(path)


def test_which_tokenizer_a_served_model_gets(tmp_path: Path) -> None:
    from pagoda.bench.tokens import DEFAULT, resolve_source

    assert resolve_source("/some/dir", "anything") == "/some/dir"
    assert resolve_source(None, str(tmp_path)) == str(tmp_path)  # a local path: the model's own
    assert resolve_source(None, "SmolLM2-135M-Instruct") == DEFAULT
    assert resolve_source(None, "HuggingFaceTB/SmolLM2-135M-Instruct") == DEFAULT
    assert resolve_source(None, "meta-llama/Llama-3-8B") is None
