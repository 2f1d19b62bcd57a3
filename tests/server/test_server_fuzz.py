"""Schemathesis fuzzes the server from its own OpenAPI schema (coverage and fuzzing phases: boundary
values, wrong types, missing fields, random bodies) and no request may get a 5xx: user input never
causes a server error. The schema is given the served model's name, so generation requests reach
the engine rather than stopping at 404, and `fuzz_hooks` keeps each one to a few new tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

import httpx
import pytest

from tests.server.helpers import API_KEY, MODEL

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
MAX_EXAMPLES = 10  # per route in the fuzzing phase; the coverage phase adds its own cases
TIME_BUDGET_S = 40  # 325 requests over every route in 30 s of a 2-core Zen 3 run (at least 200 asserted)
BODIES_WITH_MODEL = (
    "CompletionRequest",
    "ChatCompletionRequest",
    "ResponsesRequest",
    "TokenizeRequest",
    "DetokenizeRequest",
    "EmbeddingRequest",
    "ScoreRequest",
    "RerankRequest",
)
GENERATION_BODIES = ("CompletionRequest", "ChatCompletionRequest", "ResponsesRequest")
SMALL_ID = {"type": "integer", "minimum": 0, "maximum": 1000}  # inside any vocabulary
# Valid bodies keep to the ranges SamplingParams accepts, so that they reach the engine; the fuzzer
# still generates values outside them as invalid bodies.
VALID_SAMPLING = {
    "n": {"type": "integer", "minimum": 1, "maximum": 2},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"type": "integer", "minimum": -1, "maximum": 50},
    "min_p": {"type": "number", "minimum": 0, "maximum": 1},
    "repetition_penalty": {"type": "number", "exclusiveMinimum": 0, "maximum": 2},
    "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 5},
    "prompt_logprobs": {"type": "integer", "minimum": 0, "maximum": 5},
    "min_tokens": {"type": "integer", "minimum": 0, "maximum": 1},
    "seed": {"type": "integer", "minimum": 0, "maximum": 2**63 - 1},
    "stop_token_ids": {"type": "array", "items": SMALL_ID, "maxItems": 3},
    "allowed_token_ids": {"type": "array", "items": SMALL_ID, "minItems": 1, "maxItems": 3},
    "bad_words": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,8}$"}, "maxItems": 2},
    "truncate_prompt_tokens": {"type": "integer", "minimum": 1, "maximum": 100},
    "logit_bias": {
        "type": "object",
        "patternProperties": {"^[0-9]{1,3}$": {"type": "number", "minimum": -100, "maximum": 100}},
        "additionalProperties": False,
    },
}
VALID_PROMPT = {
    "anyOf": [
        {"type": "string", "minLength": 1, "maxLength": 200},
        {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": 100}, "minItems": 1, "maxItems": 2},
        {"type": "array", "items": SMALL_ID, "minItems": 1, "maxItems": 50},
    ]
}
VALID_MESSAGES = {
    "type": "array",
    "minItems": 1,
    "maxItems": 3,
    "items": {
        "type": "object",
        "required": ["role", "content"],
        "properties": {
            "role": {"enum": ["system", "user", "assistant"]},
            "content": {"type": "string", "maxLength": 200},
        },
    },
}
# Refused fields, and those whose own tests cover their values (tools, output constraints): absent
# from valid bodies, so that a valid body is not refused for them.
ABSENT = (
    "suffix",
    "best_of",
    "functions",
    "function_call",
    "audio",
    "modalities",
    "prediction",
    "web_search_options",
    "tools",
    "tool_choice",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "response_format",
    "text",
    "previous_response_id",
    "conversation",
    "background",
    "prompt",
    "include",
)


def for_the_served_model(schema: dict) -> dict:
    """The server's schema with valid bodies that the engine accepts: they name the served model
    and keep to valid ranges (the server's schema leaves both to its own checks)."""
    bodies = schema["components"]["schemas"]
    for name in BODIES_WITH_MODEL:
        bodies[name]["properties"]["model"] = {"type": "string", "enum": [MODEL]}
    for name in GENERATION_BODIES:
        properties = bodies[name]["properties"]
        properties.update({key: value for key, value in VALID_SAMPLING.items() if key in properties})
        properties.update({key: {"type": "null"} for key in ABSENT if key in properties})
    bodies["CompletionRequest"]["properties"]["prompt"] = VALID_PROMPT
    bodies["CompletionRequest"]["properties"]["logprobs"] = {"type": "integer", "minimum": 0, "maximum": 5}
    bodies["ChatCompletionRequest"]["properties"]["messages"] = VALID_MESSAGES
    bodies["ResponsesRequest"]["properties"]["input"] = {"anyOf": [VALID_PROMPT["anyOf"][0], VALID_MESSAGES]}
    return schema


def test_no_input_gets_a_server_error(server, tmp_path: Path):
    schema = for_the_served_model(httpx.get(f"{server.base_url}/openapi.json", timeout=10).json())
    schema_path = tmp_path / "openapi.json"
    schema_path.write_text(json.dumps(schema))
    report = tmp_path / "report.ndjson"
    command = [
        sys.executable,
        "-m",
        "schemathesis.cli",
        "run",
        str(schema_path),
        "--url",
        server.base_url,
        "--header",
        f"Authorization: Bearer {API_KEY}",
        "--phases",
        "coverage,fuzzing",
        "--checks",
        "not_a_server_error",
        "--max-examples",
        str(MAX_EXAMPLES),
        "--max-time",
        str(TIME_BUDGET_S),
        "--seed",
        "1",
        "--workers",
        "1",
        "--request-timeout",
        "30",
        "--no-shrink",
        "--continue-on-failure",
        "--suppress-health-check",
        "all",
        "--report",
        "ndjson",
        "--report-ndjson-path",
        str(report),
        "--generation-database",
        "none",
        "--no-color",
    ]
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "tests.server.fuzz_hooks", "PYTHONPATH": str(REPO)}
    # in tmp_path: schemathesis keeps a cache of its findings in the working directory
    run = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=TIME_BUDGET_S + 60)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    statuses = statuses_by_route(report)
    assert sum(sum(counts.values()) for counts in statuses.values()) >= 200
    for route in ("POST /v1/completions", "POST /v1/chat/completions"):
        assert statuses[route][200] >= 5, statuses  # valid bodies reached the engine


def statuses_by_route(report: Path) -> dict[str, Counter[int]]:
    """From schemathesis' NDJSON report: how often each route answered each status."""
    statuses: dict[str, Counter[int]] = defaultdict(Counter)
    for line in report.read_text().splitlines():
        scenario = json.loads(line).get("ScenarioFinished")
        if scenario is None:
            continue
        # a scenario skipped at the time limit has a recorder without interactions
        for interaction in scenario["recorder"].get("interactions", {}).values():
            if interaction.get("response"):
                statuses[scenario["recorder"]["label"]][interaction["response"]["status_code"]] += 1
    return statuses
