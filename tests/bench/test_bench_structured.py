"""The structured-output workload: its seeded requests, the grading of answers, and the share of
valid answers reported per level, by `pagoda bench` and `pagoda bakeoff` against stub servers."""

from __future__ import annotations

import csv
import itertools
import json
import shlex
from pathlib import Path

import httpx
import jsonschema
import pytest
from bench_helpers import read_results, run_bench, stub_command, write_jsonl
from bench_stub_server import example

from pagoda.bench import bakeoff, cli
from pagoda.bench.client import StreamResult
from pagoda.bench.datasets import Prompt, Workload, describe, load_replay, sessions
from pagoda.bench.metrics import RequestRecord, summarize
from pagoda.bench.runner import Exchange, to_record
from pagoda.bench.schemas import TASKS, grade, response_format, schema_of
from pagoda.bench.settings import parse_settings
from pagoda.bench.tokens import LazyTokenizer
from tests.server.helpers import free_port

PERSON_TASK = next(task for task in TASKS if task.name == "person")
PERSON = PERSON_TASK.schema


def structured(*args: str) -> Workload:
    return Workload(parse_settings(["--workload", "structured", *args]).workload)


def prompts(workload: Workload, n: int, seed: int = 0, label: str = "level0") -> list[Prompt]:
    return [s.first for s in itertools.islice(sessions(workload, None, seed, label), n)]


def test_requests_follow_the_seed_and_ask_for_their_schema() -> None:
    workload = structured()
    first = prompts(workload, 40)
    assert prompts(workload, 40) == first
    assert prompts(workload, 40, label="level1") != first
    assert prompts(workload, 40, seed=1) != first
    for prompt in first:
        fmt = prompt.body["response_format"]
        assert fmt["type"] == "json_schema" and fmt["json_schema"]["strict"] is True
        assert fmt["json_schema"]["schema"] is prompt.schema
        assert prompt.endpoint == "chat" and prompt.body["max_tokens"] == 128
        assert prompt.body["messages"][-1]["content"].endswith(json.dumps(prompt.schema, separators=(",", ":")))
    names = [p.body["response_format"]["json_schema"]["name"] for p in first]
    for start in (0, len(TASKS)):  # each round asks every schema once, in its own order
        assert sorted(names[start : start + len(TASKS)]) == sorted(task.name for task in TASKS)
    assert names[: len(TASKS)] != names[len(TASKS) : 2 * len(TASKS)]
    assert len({p.body["messages"][-1]["content"] for p in first}) > len(TASKS)  # subjects vary


def test_options_and_endpoint_of_the_workload() -> None:
    completion = prompts(structured("--endpoint", "completions", "--output-len", "50:60"), 3)
    assert all(p.endpoint == "completions" and p.body["prompt"].endswith("\nJSON:") for p in completion)
    assert all(50 <= p.body["max_tokens"] <= 60 and "response_format" in p.body for p in completion)
    assert parse_settings([]).workload.endpoint == "completions"  # other workloads keep theirs
    settings = parse_settings(["--workload", "structured"])
    assert not settings.workload.needs_tokenizer and not settings.ignore_eos
    assert "16 JSON schemas" in describe(settings.workload) and "128 tokens" in describe(settings.workload)


@pytest.mark.parametrize("task", TASKS, ids=lambda task: task.name)
def test_every_schema_is_valid_bounded_and_compiles(task) -> None:
    import xgrammar

    jsonschema.validators.validator_for(task.schema).check_schema(task.schema)
    xgrammar.Grammar.from_json_schema(json.dumps(task.schema), strict_mode=True)
    assert grade(json.dumps(example(task.schema, task.schema)), task.schema) is None
    assert grade(json.dumps(example(task.schema, task.schema) | {"extra": 1}), task.schema) is not None
    strings = [node for node in _nodes(task.schema) if node.get("type") == "string"]
    arrays = [node for node in _nodes(task.schema) if node.get("type") == "array"]
    assert all("maxLength" in node for node in strings) and all("maxItems" in node for node in arrays)


def _nodes(schema):
    if isinstance(schema, dict):
        yield schema
        for value in schema.values():
            yield from _nodes(value)
    elif isinstance(schema, list):
        for value in schema:
            yield from _nodes(value)


def test_the_set_has_every_shape() -> None:
    text = json.dumps([task.schema for task in TASKS])
    for keyword in ('"$ref"', '"$defs"', '"anyOf"', '"enum"', '"const"', '"minItems"', '"maximum"', '"null"'):
        assert keyword in text
    assert any(len(task.schema["required"]) < len(task.schema["properties"]) for task in TASKS)  # optional fields
    assert 12 <= len(TASKS) <= 16 and len({task.name for task in TASKS}) == len(TASKS)


@pytest.mark.parametrize(
    "text, cut, problem",
    [
        ('{"name": "Ana", "age": 31, "job": "nurse"}', False, None),
        (' \n{"name":"Ana","age":31,"job":"nurse"}\n', False, None),
        ('{"name": "Ana", "age": 31, "job": "nu', True, "not JSON (the output reached max_tokens): Unterminated"),
        ('{"name": "Ana", "age": 31,}', False, "not JSON: Expecting property name"),
        ('```json\n{"name": "Ana", "age": 31, "job": "nurse"}\n```', False, "not JSON: Expecting value at character 0"),
        ('{"name": "Ana", "age": 310, "job": "nurse"}', False, "does not match the schema at age: 310 is greater"),
        ('{"name": "Ana", "job": "nurse"}', False, "does not match the schema at the top level: 'age' is a required"),
        ('{"name": "Ana", "age": 3, "job": "x", "pet": "cat"}', False, "Additional properties are not allowed"),
        ("", True, "not JSON (the output reached max_tokens): Expecting value at character 0"),
    ],
)
def test_grading(text: str, cut: bool, problem: str | None) -> None:
    found = grade(text, PERSON, cut)
    assert found is None if problem is None else problem in found


def test_schema_of_request_bodies_and_replayed_ones(tmp_path: Path) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    as_schema = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    assert schema_of({"response_format": as_schema}) == schema
    assert schema_of({"response_format": {"type": "json_object"}}) == {"type": "object"}
    assert schema_of({"response_format": {"type": "text"}}) is None and schema_of({}) is None
    path = write_jsonl(
        tmp_path / "r.jsonl",
        [{"messages": [{"role": "user", "content": "a"}], "response_format": as_schema}, {"prompt": "b"}],
    )
    assert [p.schema for p in load_replay(path, "chat")] == [schema, None]


def exchange(prompt: Prompt, result: StreamResult) -> Exchange:
    return Exchange(0, 0, 0, prompt, result, 0.0)


def test_records_grade_the_answer_not_the_reasoning() -> None:
    prompt = Prompt("chat", {"response_format": response_format(PERSON_TASK)})
    answer = '{"name": "Ana", "age": 31, "job": "nurse"}'
    thinking = StreamResult(0.0, (0.1, 0.2), "Let me think." + answer, 9, 2, None, answer, "stop")
    record = to_record(exchange(prompt, thinking), 0.0, LazyTokenizer(None))
    assert (record.schema_valid, record.schema_error) == (True, None)
    cut = StreamResult(0.0, (0.1,), answer[:10], 9, 1, None, answer[:10], "length")
    record = to_record(exchange(prompt, cut), 0.0, LazyTokenizer(None))
    assert record.schema_valid is False and "reached max_tokens" in record.schema_error
    failed = StreamResult(0.0, (), "", None, None, "HTTP 400: bad schema")
    assert to_record(exchange(prompt, failed), 0.0, LazyTokenizer(None)).schema_valid is None
    plain = to_record(exchange(Prompt("chat", {}), thinking), 0.0, LazyTokenizer(None))
    assert (plain.schema_valid, plain.schema_error) == (None, None)


def test_the_share_counts_graded_completed_requests_only() -> None:
    def record(valid: bool | None, error: str | None = None) -> RequestRecord:
        return RequestRecord(0, 0, 0, 0.0, 0.1, 0.2, (0.1,), 5, 2, "usage", error, valid)

    records = [record(True), record(True), record(False), record(None, "HTTP 500"), record(None)]
    assert summarize(records, 1.0, None).schema_valid_rate == pytest.approx(2 / 3)
    assert summarize([record(None)], 1.0, None).schema_valid_rate is None


def test_bench_reports_the_share_of_valid_answers(start_stub, tmp_path: Path, capsys) -> None:
    stub = start_stub("--ttft", "0.01", "--itl", "0.001", "--invalid-every", "3")
    args = ["--workload", "structured", "--num-prompts", "12", "--concurrency", "1,3", "--warmup", "0"]
    code = cli.main(["--base-url", stub.base_url, "--no-progress", "--output", str(tmp_path), *args])
    assert code == 0
    captured = capsys.readouterr()
    assert "66.7% structured outputs valid" in captured.err  # each level's one-line summary
    row = next(line for line in captured.out.splitlines() if line.startswith("structured outputs valid"))
    assert row.split()[-2:] == ["66.7%", "66.7%"]
    levels = read_results(tmp_path)["engines"][0]["levels"]
    for level in levels:  # every third answer the stub sent was broken: 4 of 12 in each level
        assert level["summary"]["schema_valid_rate"] == pytest.approx(8 / 12)
        errors = sorted(r["schema_error"] for r in level["records"] if not r["schema_valid"])
        assert len(errors) == 4 and all(r["schema_valid"] is not None for r in level["records"])
        assert sum(e.startswith("not JSON: ") for e in errors) == 2
        assert sum("does not match the schema at the top level" in e for e in errors) == 2
    with (tmp_path / "results.csv").open() as handle:
        assert [float(row["schema_valid_rate"]) for row in csv.DictReader(handle)] == pytest.approx([8 / 12] * 2)
    report = (tmp_path / "report.md").read_text()
    assert "| structured outputs valid (higher is better) | 66.7% | 66.7% |" in report
    assert "- tokenizer: (default)\n" in report and "`None`" not in report  # a setting left to its default
    sent = httpx.get(f"{stub.base_url}/stub/requests").json()
    assert len(sent) == 24 and all(b["response_format"]["type"] == "json_schema" for b in sent)
    assert all(b["temperature"] == 0 and b["max_tokens"] == 128 and "ignore_eos" not in b for b in sent)


def test_answers_cut_at_max_tokens_do_not_validate(start_stub) -> None:
    stub = start_stub("--ttft", "0.01", "--itl", "0.001")
    result = run_bench(stub.base_url, "--workload", "structured", "--output-len", "3", "--num-prompts", "4")
    level = result.levels[0]
    assert result.status == "ok" and level.summary.schema_valid_rate == 0.0
    assert all("(the output reached max_tokens)" in r.schema_error for r in level.records)


def test_other_workloads_show_no_structured_figures(start_stub, tmp_path: Path, capsys) -> None:
    stub = start_stub("--ttft", "0.01", "--itl", "0.001")
    data = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a", "max_tokens": 2}] * 2)
    assert (
        cli.main(["--base-url", stub.base_url, "--no-progress", "--dataset", str(data), "--output", str(tmp_path)]) == 0
    )
    assert "structured outputs valid" not in capsys.readouterr().out + (tmp_path / "report.md").read_text()
    record = read_results(tmp_path)["engines"][0]["levels"][0]["records"][0]
    assert record["schema_valid"] is None and record["schema_error"] is None


def test_bakeoff_grades_each_engine(tmp_path: Path) -> None:
    def engine(name: str, *stub_args: str) -> str:
        port = free_port()
        command = shlex.join(stub_command("--ttft", "0.01", "--itl", "0.001", *stub_args, port=port))
        return f'[[engine]]\nname = "{name}"\ncommand = {json.dumps(command)}\nbase_url = "http://127.0.0.1:{port}"\n'

    config = tmp_path / "s.toml"
    config.write_text(
        '[workload]\nworkload = "structured"\nnum_prompts = 8\nconcurrency = [2]\nwarmup = 0\n\n'
        + engine("constrained")
        + engine("sloppy", "--invalid-every", "2")
    )
    assert bakeoff.main([str(config), "--output", str(tmp_path / "out"), "--no-progress"]) == 0
    rates = [e["levels"][0]["summary"]["schema_valid_rate"] for e in read_results(tmp_path / "out")["engines"]]
    assert rates == [1.0, 0.5]
    report = (tmp_path / "out" / "report.md").read_text()
    assert "| metric | concurrency | constrained | sloppy | sloppy / constrained |" in report
    assert "| structured outputs valid (higher is better) | 2 | 100.0% | 50.0% | 0.50x worse |" in report
    assert "structured: 16 JSON schemas" in report
