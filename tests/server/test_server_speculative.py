"""`pagoda serve --speculative-config` (vLLM's spelling): a streamed greedy answer equals the
plain server's, and /metrics counts drafts, draft tokens and accepted tokens (per position too);
a request with a JSON schema speculates too and returns the plain server's answer."""

from __future__ import annotations

import json
import os
import signal

import openai
import pytest

from pagoda.core.outputs import SchedulerStats
from pagoda.entrypoints.openai.stats_log import Snapshot, stats_line
from tests.engine.test_speculative import COPY_SCHEMA, EDIT_PROMPT
from tests.server.conftest import _launch
from tests.server.helpers import MODEL, metric, wait_idle

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def spec_server(tmp_path_factory):
    config = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    server = _launch(
        tmp_path_factory.mktemp("spec"),
        "spec",
        "--kv-cache-memory",
        "0.25",
        "--max-model-len",
        "2048",
        "--speculative-config",
        json.dumps(config),
    )
    yield server.wait_healthy()
    os.killpg(server.process.pid, signal.SIGKILL)
    server.process.wait(timeout=30)


def test_speculative_server_streams_the_plain_servers_answer_and_counts_drafts(spec_server, client):
    spec = openai.OpenAI(base_url=spec_server.base_url + "/v1", api_key="none")
    stream = spec.chat.completions.create(model=MODEL, messages=EDIT_PROMPT, max_tokens=64, temperature=0, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    plain = client.chat.completions.create(model=MODEL, messages=EDIT_PROMPT, max_tokens=64, temperature=0)
    assert text == plain.choices[0].message.content
    after = wait_idle(spec_server.base_url)
    drafts = metric(after, "pagoda:spec_decode_num_drafts_total")
    proposed = metric(after, "pagoda:spec_decode_num_draft_tokens_total")
    accepted = metric(after, "pagoda:spec_decode_num_accepted_tokens_total")
    per_position = [
        metric(after, "pagoda:spec_decode_num_accepted_tokens_per_pos_total", position=str(i)) for i in range(4)
    ]
    assert 0 < accepted <= proposed <= 4 * drafts
    assert sum(per_position) == accepted and per_position == sorted(per_position, reverse=True)


def test_a_json_schema_request_speculates_and_returns_the_plain_answer(spec_server, client):
    document = '{"name": "Ada Lovelace", "tags": ["math", "code"], "admin": false}'
    messages = [{"role": "user", "content": f"Copy this JSON exactly, nothing else: {document}"}]
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": COPY_SCHEMA}}
    spec = openai.OpenAI(base_url=spec_server.base_url + "/v1", api_key="none")
    before = wait_idle(spec_server.base_url)
    answers = [
        c.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=60, temperature=0, response_format=response_format
        ).choices[0]
        for c in (spec, client)
    ]
    after = wait_idle(spec_server.base_url)
    assert answers[0].message.content == answers[1].message.content == document
    assert answers[0].finish_reason == "stop"

    def grew(name: str) -> float:
        return metric(after, name) - metric(before, name)

    assert grew("pagoda:spec_decode_num_accepted_tokens_total") > 0.5 * grew(
        "pagoda:spec_decode_num_draft_tokens_total"
    )


def test_the_engine_line_reports_mean_acceptance_length_over_the_interval():
    before = Snapshot(SchedulerStats(spec_num_drafts=10, spec_num_draft_tokens=40, spec_num_accepted_tokens=20), 0.0)
    after = SchedulerStats(spec_num_drafts=30, spec_num_draft_tokens=120, spec_num_accepted_tokens=50)
    line = stats_line(before, Snapshot(after, 10.0), "CPU")
    assert line.endswith("Mean acceptance length: 2.50, Draft acceptance rate: 37.5%")
    assert "acceptance" not in stats_line(Snapshot(after, 0.0), Snapshot(after, 10.0), "CPU")  # none in the interval
