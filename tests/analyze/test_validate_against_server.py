"""The analyzer's prediction against Pagoda's own server: replay requests one at a time through a
server whose cache holds them all, then check that the predicted cached tokens of every logged
request (block granularity, unlimited cache) are exactly what the server reported in
`usage.prompt_tokens_details.cached_tokens`."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time

import httpx
import pytest

if importlib.util.find_spec("pagoda.entrypoints.openai.serve") is None:
    pytest.skip("the Pagoda server (pagoda.entrypoints.openai.serve) is not built yet", allow_module_level=True)

from openai import OpenAI

from pagoda.analyze.cli import main
from pagoda.analyze.logs import parse_line
from pagoda.analyze.pipeline import analyze_log
from pagoda.analyze.tokenize import PromptTokenizer
from tests.server.helpers import free_port

from .conftest import STORY, SYSTEM

pytestmark = pytest.mark.slow

STARTUP_TIMEOUT_S = 300
WEATHER_TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A Pagoda server on a free loopback port, writing its request log; yields (client, log path)."""
    log = tmp_path_factory.mktemp("server") / "requests.jsonl"
    port = free_port()
    command = [sys.executable, "-m", "pagoda.entrypoints.cli", "serve", "--port", str(port), "--request-log", str(log)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_until_ready(process, port)
        yield OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0), log, process
    finally:
        process.terminate()
        process.wait(timeout=60)


def _wait_until_ready(process: subprocess.Popen, port: int) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"the server exited with {process.returncode}:\n{process.stdout.read()}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    pytest.fail(f"the server did not answer within {STARTUP_TIMEOUT_S} s")


def replay(client: OpenAI) -> list[int]:
    """Requests one at a time (each reuses what the ones before left cached); the server's
    reported cached tokens of each."""
    model = client.models.list().data[0].id
    common = {"model": model, "max_tokens": 3, "temperature": 0.0}  # short: each engine step is slow on CPU
    first_turn = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Where is the Eiffel Tower?"}]
    responses = [client.chat.completions.create(messages=first_turn, **common)]
    answer = responses[0].choices[0].message.content
    second_turn = first_turn + [
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "And how tall is it?"},
    ]
    other_question = [first_turn[0], {"role": "user", "content": "Where is the Colosseum?"}]
    for messages in (other_question, second_turn, first_turn):  # the last: a repeat, one token computed
        responses.append(client.chat.completions.create(messages=messages, **common))
    # tools, shown to the model (in the generic format: the default model's template shows none)
    responses.append(
        client.chat.completions.create(messages=first_turn, tools=[WEATHER_TOOL], tool_choice="none", **common)
    )
    for prompt in (STORY, STORY + " sailed without lights", STORY):
        responses.append(client.completions.create(prompt=prompt, **common))
    for salt in ("tenant-a", "tenant-a", "tenant-b"):  # each salt a cache of its own: miss, hit, miss
        responses.append(client.completions.create(prompt=STORY, extra_body={"cache_salt": salt}, **common))
    cached = []
    for response in responses:
        details = response.usage.prompt_tokens_details
        assert details is not None, "the server must report usage.prompt_tokens_details.cached_tokens"
        cached.append(details.cached_tokens)
    return cached


def test_predicted_cached_tokens_match_the_server(server, default_tokenizer, capsys):
    client, log, process = server
    reported = replay(client)
    process.terminate()  # the log is complete once the server has stopped
    process.wait(timeout=60)
    records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    assert len(records) == len(reported), "one log line per request"
    assert [r["cached_tokens"] for r in records] == reported, "the log must agree with the responses"

    analysis = analyze_log(log, PromptTokenizer(None, tokenizer=default_tokenizer))
    predicted = analysis.simulation.reusable("block").tolist()
    assert analysis.malformed_count == 0
    assert any(reported), "the replay must exercise the cache"
    assert reported[-3] == 0 < reported[-2] and reported[-1] == 0, "salted requests share only within a salt"
    if all("output_token_ids" in r for r in records):
        assert predicted == reported
    else:
        # Without output ids the analyzer caches prompts only, while the server also caches the
        # answer it generated; the second turn (request 3), whose prompt holds the first answer,
        # can then reuse more on the server. Every other request must match exactly.
        assert predicted[:2] + predicted[3:] == reported[:2] + reported[3:]
        assert predicted[2] <= reported[2]

    # each chat body, tokenized by the analyzer as if the log had no ids, gives the server's ids
    tokenizer = PromptTokenizer(None, tokenizer=default_tokenizer)
    chats = [r for r in records if "messages" in r["body"]]
    assert any("tools" in r["body"] for r in chats)
    for record in chats:
        [entry] = parse_line(json.dumps({"body": record["body"]}).encode(), 1)
        assert tokenizer.ids(entry.prompt).tolist() == record["prompt_token_ids"], record["body"]

    assert main([str(log), "--json"]) == 0
    check = json.loads(capsys.readouterr().out)["server_check"]
    assert check["requests"] == len(reported)
    assert check["logged_cached_tokens"] == sum(reported)
