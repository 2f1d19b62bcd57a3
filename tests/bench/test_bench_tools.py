"""The tool-calling workload: its seeded requests, the assembly of streamed calls, the grading of
calls and the comparison of streamed with non-streamed ones, and both shares reported per level,
by `pagoda bench` and `pagoda bakeoff` against stub servers."""

from __future__ import annotations

import asyncio
import csv
import itertools
import json
import re
import shlex
from collections.abc import Callable
from pathlib import Path

import httpx
import jsonschema
import pytest
from aiohttp import web
from bench_helpers import Handler, http_server, read_results, run_bench, sse_handler, stub_command, write_jsonl
from bench_stub_server import example

from pagoda.bench import bakeoff, cli
from pagoda.bench.client import StreamResult, Target, WholeResult, make_client, stream_request, whole_request
from pagoda.bench.datasets import Prompt, Workload, describe, load_replay, sessions
from pagoda.bench.metrics import RequestRecord, summarize
from pagoda.bench.runner import Exchange, to_record
from pagoda.bench.settings import UsageError, parse_settings
from pagoda.bench.tokens import LazyTokenizer
from pagoda.bench.tool_calls import BY_NAME, TOOLS, Call, compare_calls, grade_calls, requires_calls, tools_of
from tests.server.helpers import free_port

WEATHER = BY_NAME["get_weather"]
OFFERED = {"get_weather": WEATHER.parameters, "get_time": BY_NAME["get_time"].parameters}
LISBON = '{"city": "Lisbon", "unit": "celsius"}'


def tools_workload(*args: str) -> Workload:
    return Workload(parse_settings(["--workload", "tools", *args]).workload)


def prompts(workload: Workload, n: int, seed: int = 0, label: str = "level0") -> list[Prompt]:
    return [s.first for s in itertools.islice(sessions(workload, None, seed, label), n)]


def asked_tool(prompt: Prompt) -> str:
    """The tool whose request the prompt's text is."""
    text = prompt.body["messages"][-1]["content"]
    (name,) = [t.name for t in TOOLS if any(t.request.format(subject) == text for subject in t.subjects)]
    return name


def test_requests_follow_the_seed_and_offer_the_tool_they_ask_for() -> None:
    workload = tools_workload()
    first = prompts(workload, 2 * len(TOOLS))
    assert prompts(workload, 2 * len(TOOLS)) == first
    assert prompts(workload, 2 * len(TOOLS), label="level1") != first
    assert prompts(workload, 2 * len(TOOLS), seed=1) != first
    for prompt in first:
        offered = [tool["function"]["name"] for tool in prompt.body["tools"]]
        assert len(offered) == len(set(offered)) == 3 and asked_tool(prompt) in offered
        assert prompt.endpoint == "chat" and prompt.calls_expected and prompt.body["max_tokens"] == 200
        assert prompt.body["tool_choice"] == "required" and prompt.body["parallel_tool_calls"] is False
        assert prompt.tools == {name: BY_NAME[name].parameters for name in offered}
        assert prompt.schema is None
    asked = [asked_tool(p) for p in first]
    for start in (0, len(TOOLS)):  # each round asks for every tool once, in its own order
        assert sorted(asked[start : start + len(TOOLS)]) == sorted(tool.name for tool in TOOLS)
    assert asked[: len(TOOLS)] != asked[len(TOOLS) :]
    assert len({tuple(t["function"]["name"] for t in p.body["tools"]) for p in first}) > len(TOOLS) // 2


def test_tool_choice_options() -> None:
    for prompt in prompts(tools_workload("--tool-choice", "named"), len(TOOLS)):
        assert prompt.body["tool_choice"] == {"type": "function", "function": {"name": asked_tool(prompt)}}
    assert all(p.body["tool_choice"] == "auto" for p in prompts(tools_workload("--tool-choice", "auto"), 5))
    settings = parse_settings(["--workload", "tools", "--output-len", "64"])
    assert settings.workload.endpoint == "chat" and not settings.workload.needs_tokenizer and not settings.ignore_eos
    assert all(p.body["max_tokens"] == 64 for p in prompts(Workload(settings.workload), 3))
    text = describe(parse_settings(["--workload", "tools", "--tool-choice", "named"]).workload)
    assert "12 tools" in text and "tool_choice named" in text and "200 tokens" in text
    with pytest.raises(UsageError, match="--tool-choice is for the tools workload, not random"):
        parse_settings(["--tool-choice", "auto"])
    with pytest.raises(UsageError, match="needs the chat endpoint"):
        parse_settings(["--workload", "tools", "--endpoint", "completions"])


@pytest.mark.parametrize("tool", TOOLS, ids=lambda tool: tool.name)
def test_every_tool_is_valid_bounded_and_compiles(tool) -> None:
    import xgrammar

    from pagoda.structured.compiler import check_supported

    schema = tool.parameters
    jsonschema.validators.validator_for(schema).check_schema(schema)
    check_supported(schema)  # Pagoda accepts it as a tool's parameters
    xgrammar.Grammar.from_json_schema(json.dumps(schema), strict_mode=True)
    valid = example(schema, schema)
    assert grade_calls([Call(tool.name, json.dumps(valid))], {tool.name: schema}) is None
    assert grade_calls([Call(tool.name, json.dumps(valid | {"extra": 1}))], {tool.name: schema}) is not None
    for node in schema["properties"].values():
        assert node.get("type") in ("integer", "boolean") or "enum" in node or "maxLength" in node
        assert node.get("type") != "integer" or {"minimum", "maximum"} <= node.keys()
    assert all("{}" not in subject for subject in tool.subjects) and tool.request.count("{}") == 1


def test_the_set_of_tools() -> None:
    assert 8 <= len(TOOLS) <= 12 and len(BY_NAME) == len(TOOLS)
    assert {"get_weather", "get_time", "convert_currency", "search_web", "create_calendar_event"} <= BY_NAME.keys()
    assert any(len(t.parameters["required"]) < len(t.parameters["properties"]) for t in TOOLS)  # optional arguments
    spec = WEATHER.spec()
    assert spec["type"] == "function" and spec["function"]["parameters"] is WEATHER.parameters


@pytest.mark.parametrize(
    "calls, cut, problem",
    [
        ([Call("get_weather", LISBON)], False, None),
        ([Call("get_weather", '{"city":"Lisbon"}'), Call("get_time", '{"city": "Oslo"}')], False, None),
        ([Call("get_weather", '{"city": "Lis')], True, "call 0 (get_weather) arguments: not JSON (the output reached"),
        ([Call("get_weather", "city=Lisbon")], False, "call 0 (get_weather) arguments: not JSON: Expecting value"),
        ([Call("get_weather", '["Lisbon"]')], False, "at the top level: ['Lisbon'] is not of type 'object'"),
        ([Call("get_weather", '{"city": "Lisbon", "unit": "kelvin"}')], False, "schema at unit: 'kelvin' is not one"),
        ([Call("get_weather", '{"town": "Lisbon"}')], False, "does not match the schema at the top level"),
        ([Call("get_weather", LISBON), Call("get_time", "{}")], False, "call 1 (get_time) arguments: does not match"),
        ([Call("get_stock_price", '{"symbol": "AAPL"}')], False, "call 0: 'get_stock_price' is not one of the request"),
        ([], False, "no tool calls"),
        ([], True, "no tool calls (the output reached max_tokens)"),
    ],
)
def test_grading(calls: list[Call], cut: bool, problem: str | None) -> None:
    found = grade_calls(calls, OFFERED, cut)
    assert found is None if problem is None else problem in found


@pytest.mark.parametrize(
    "streamed, whole, difference",
    [
        ([Call("get_weather", LISBON)], [Call("get_weather", LISBON)], None),
        ([], [], None),
        ([Call("get_weather", LISBON)], [], "1 calls streamed, 0 not streamed"),
        (
            [Call("get_weather", LISBON)],
            [Call("get_time", LISBON)],
            "call 0: streamed 'get_weather', not streamed 'get_time'",
        ),
        (
            [Call("get_weather", '{"city": "Lisbon"}')],
            [Call("get_weather", '{"city":"Lisbon"}')],  # the same object, not the same bytes
            """call 0 (get_weather) arguments: streamed '{"city": "Lisbon"}', not streamed '{"city":"Lisbon"}'""",
        ),
        (
            [Call("get_time", "{}"), Call("get_weather", LISBON)],
            [Call("get_weather", LISBON), Call("get_time", "{}")],  # order counts
            "call 0: streamed 'get_time', not streamed 'get_weather'",
        ),
    ],
)
def test_agreement(streamed: list[Call], whole: list[Call], difference: str | None) -> None:
    assert compare_calls(streamed, whole) == difference


def sse(*chunks: dict) -> list[bytes]:
    return [f"data: {json.dumps(chunk)}\n\n".encode() for chunk in chunks] + [b"data: [DONE]\n\n"]


def call_delta(index: int, arguments: str, name: str | None = None) -> dict:
    entry: dict = {"index": index, "function": {"arguments": arguments}}
    if name is not None:
        entry |= {"id": f"call_{index}", "type": "function", "function": {"name": name, "arguments": arguments}}
    return {"choices": [{"index": 0, "delta": {"tool_calls": [entry]}, "finish_reason": None}]}


def mocked(handler: Handler, send: Callable) -> object:
    """`send` (stream_request or whole_request) to a real server answering with `handler`."""

    async def go() -> object:
        async with http_server(handler) as url, make_client(1, 5.0) as http:
            return await send(http, Target(url, "m"), Prompt("chat", {"messages": [], "tools": []}))

    return asyncio.run(go())


def answer(status: int, payload: object, seen: list[dict] | None = None) -> Handler:
    async def handle(request: web.Request) -> web.StreamResponse:
        if seen is not None:
            seen.append(await request.json())
        return web.json_response(payload, status=status)

    return handle


def test_streamed_tool_call_deltas_are_assembled_and_timed() -> None:
    chunks = sse(
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
        call_delta(0, "", "get_weather"),
        call_delta(0, '{"city": '),
        call_delta(1, '{"ci', "get_time"),  # a second call, its arguments starting with its name
        call_delta(0, '"Lisbon"}'),
        call_delta(1, 'ty": "Oslo"}'),
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
        {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 20}},
    )

    result = mocked(sse_handler(chunks, pause_s=0.01), stream_request)
    assert isinstance(result, StreamResult) and result.error is None
    assert result.tool_calls == (Call("get_weather", '{"city": "Lisbon"}'), Call("get_time", '{"city": "Oslo"}'))
    assert len(result.token_times) == 5 and result.finish_reason == "tool_calls" and result.answer == ""


def test_the_request_without_streaming() -> None:
    seen: list[dict] = []
    calls = [{"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": LISBON}}]

    message = {"role": "assistant", "content": None, "tool_calls": calls}
    whole = {"choices": [{"index": 0, "message": message}]}
    assert mocked(answer(200, whole, seen), whole_request) == WholeResult((Call("get_weather", LISBON),))
    assert seen[0]["stream"] is False and "stream_options" not in seen[0] and seen[0]["temperature"] == 0
    text = {"choices": [{"message": {"role": "assistant", "content": "no"}}]}
    assert mocked(answer(200, text), whole_request) == WholeResult(())
    failed = mocked(answer(500, {"error": {"message": "boom"}}), whole_request)
    assert failed == WholeResult((), "HTTP 500: boom")
    assert mocked(answer(200, {}), whole_request) == WholeResult((), "malformed answer: '{}'")


def exchange(prompt: Prompt, result: StreamResult, whole: WholeResult | None = None) -> Exchange:
    return Exchange(0, 0, 0, prompt, result, 0.0, whole)


def record(prompt: Prompt, result: StreamResult, whole: WholeResult | None = None) -> RequestRecord:
    return to_record(exchange(prompt, result, whole), 0.0, LazyTokenizer(None))


def test_records_grade_the_calls_and_compare_them() -> None:
    prompt = Prompt("chat", {"tools": [WEATHER.spec()], "tool_choice": "required"}, calls_expected=True)
    call = Call("get_weather", LISBON)
    answered = StreamResult(0.0, (0.1, 0.2), "x", 9, 2, None, "", "tool_calls", (call,))
    same = record(prompt, answered, WholeResult((call,)))
    assert (same.tool_calls_valid, same.tool_calls_error, same.tool_calls_agree, same.tool_calls_difference) == (
        True,
        None,
        True,
        None,
    )
    spaced = record(prompt, answered, WholeResult((Call("get_weather", LISBON.replace(" ", "")),)))
    assert spaced.tool_calls_agree is False and "not streamed" in spaced.tool_calls_difference
    broken = record(prompt, answered, WholeResult((), "HTTP 500: boom"))
    assert broken.tool_calls_difference == "the request without streaming failed: HTTP 500: boom"
    unsent = record(prompt, answered)
    assert unsent.tool_calls_valid and unsent.tool_calls_agree is None
    cut = StreamResult(0.0, (0.1,), "x", 9, 1, None, "", "length", (Call("get_weather", '{"ci'),))
    assert "(the output reached max_tokens)" in record(prompt, cut).tool_calls_error
    failed = StreamResult(0.0, (), "", None, None, "HTTP 400: bad tools")
    assert record(prompt, failed).tool_calls_valid is None
    plain = record(Prompt("chat", prompt.body), answered)  # no call expected: not graded
    assert (plain.tool_calls_valid, plain.tool_calls_error) == (None, None)


def test_the_shares_count_graded_completed_requests_only() -> None:
    def rec(valid: bool | None, agree: bool | None, error: str | None = None) -> RequestRecord:
        return RequestRecord(
            0, 0, 0, 0.0, 0.1, 0.2, (0.1,), 5, 2, "usage", error, tool_calls_valid=valid, tool_calls_agree=agree
        )

    records = [rec(True, True), rec(True, None), rec(False, False), rec(None, None, "HTTP 500"), rec(None, None)]
    summary = summarize(records, 1.0, None)
    assert summary.tool_calls_valid_rate == pytest.approx(2 / 3) and summary.tool_calls_agree_rate == 0.5
    assert summary.schema_valid_rate is None
    assert summarize([rec(None, None)], 1.0, None).tool_calls_valid_rate is None


def test_replayed_bodies_that_force_a_call_are_graded(tmp_path: Path) -> None:
    tools = [WEATHER.spec(), {"type": "function", "function": {"name": "ping"}}]
    message = [{"role": "user", "content": "a"}]
    forced = {"tools": tools, "tool_choice": "required"}
    assert requires_calls(forced) and requires_calls(forced | {"tool_choice": {"function": {"name": "ping"}}})
    assert not requires_calls(forced | {"tool_choice": "auto"}) and not requires_calls({"tool_choice": "required"})
    assert tools_of(forced) == {"get_weather": WEATHER.parameters, "ping": {"type": "object"}}
    path = write_jsonl(
        tmp_path / "r.jsonl",
        [{"messages": message, **forced}, {"messages": message, "tools": tools}, {"messages": message}],
    )
    assert [p.calls_expected for p in load_replay(path, "chat")] == [True, False, False]


def bench_tools(stub_url: str, tmp_path: Path, *args: str) -> int:
    options = ["--workload", "tools", "--num-prompts", "12", "--concurrency", "1,3", "--warmup", "0", *args]
    return cli.main(["--base-url", stub_url, "--no-progress", "--output", str(tmp_path), *options])


def test_bench_reports_the_share_of_valid_calls(start_stub, tmp_path: Path, capsys) -> None:
    stub = start_stub("--ttft", "0.01", "--itl", "0.001", "--invalid-tools-every", "3")
    assert bench_tools(stub.base_url, tmp_path) == 0
    captured = capsys.readouterr()
    assert "66.7% tool calls valid; 100.0% streamed = non-streamed calls" in captured.err
    assert "sending 12 requests again without streaming" in captured.err
    rows = {cells[0]: cells[1:] for cells in (re.split(r"\s{2,}", line) for line in captured.out.splitlines())}
    assert rows["tool calls valid"] == ["66.7%", "66.7%"] and rows["streamed = non-streamed calls"] == ["100.0%"] * 2
    assert "structured outputs valid" not in captured.out
    for level in read_results(tmp_path)["engines"][0]["levels"]:
        # Every third answer the stub sent was invalid, each kind in turn: 4 of 12 in each level.
        assert level["summary"]["completed"] == 12 and level["summary"]["tool_calls_valid_rate"] == pytest.approx(
            8 / 12
        )
        errors = sorted(r["tool_calls_error"] for r in level["records"] if not r["tool_calls_valid"])
        assert len(errors) == 4 and errors[-1] == "no tool calls"
        assert any(" arguments: not JSON: " in e for e in errors)
        assert any("arguments: does not match the schema at the top level" in e for e in errors)
        assert any("'no_such_tool' is not one of the request's tools" in e for e in errors)
        assert all(r["tool_calls_agree"] for r in level["records"])
        assert all(r["output_tokens"] > 2 and r["ttft_s"] < r["latency_s"] for r in level["records"])
    with (tmp_path / "results.csv").open() as handle:
        table = list(csv.DictReader(handle))
    assert [float(row["tool_calls_valid_rate"]) for row in table] == pytest.approx([8 / 12] * 2)
    assert [float(row["tool_calls_agree_rate"]) for row in table] == [1.0, 1.0]
    report = (tmp_path / "report.md").read_text()
    assert "| tool calls valid (higher is better) | 66.7% | 66.7% |" in report
    assert "| streamed = non-streamed calls (higher is better) | 100.0% | 100.0% |" in report
    assert "structured outputs valid" not in report
    sent = httpx.get(f"{stub.base_url}/stub/requests").json()
    streamed, whole = [b for b in sent if b["stream"]], [b for b in sent if not b["stream"]]
    assert len(streamed) == len(whole) == 24 and all("stream_options" not in b for b in whole)
    assert all(b["temperature"] == 0 and b["max_tokens"] == 200 and "ignore_eos" not in b for b in sent)
    # Each level's re-sends come after its streamed requests, so they are outside its timing.
    assert [b["stream"] for b in sent] == ([True] * 12 + [False] * 12) * 2
    assert [b["messages"] for b in sent[12:24]] == [b["messages"] for b in sent[:12]]


def test_bench_reports_streamed_calls_that_differ(start_stub, tmp_path: Path, capsys) -> None:
    stub = start_stub("--ttft", "0.01", "--itl", "0.001", "--tools-differ-every", "4")
    assert bench_tools(stub.base_url, tmp_path, "--tool-choice", "named") == 0
    assert "100.0% tool calls valid; 75.0% streamed = non-streamed calls" in capsys.readouterr().err
    for level in read_results(tmp_path)["engines"][0]["levels"]:
        assert level["summary"]["tool_calls_agree_rate"] == 0.75
        differences = [r["tool_calls_difference"] for r in level["records"] if not r["tool_calls_agree"]]
        assert len(differences) == 3 and all(", not streamed '{" in d for d in differences)
    sent = httpx.get(f"{stub.base_url}/stub/requests").json()
    assert all(b["tool_choice"]["type"] == "function" for b in sent)


def test_no_comparison_away_from_temperature_zero(start_stub, tmp_path: Path) -> None:
    stub = start_stub("--ttft", "0.01", "--itl", "0.001")
    result = run_bench(stub.base_url, "--workload", "tools", "--num-prompts", "4", "--temperature", "0.7")
    summary = result.levels[0].summary
    assert result.status == "ok" and summary.tool_calls_valid_rate == 1.0 and summary.tool_calls_agree_rate is None
    assert all(b["stream"] for b in httpx.get(f"{stub.base_url}/stub/requests").json())


def test_calls_cut_at_max_tokens_do_not_validate(start_stub) -> None:
    stub = start_stub("--ttft", "0.01", "--itl", "0.001")
    result = run_bench(stub.base_url, "--workload", "tools", "--output-len", "3", "--num-prompts", "4")
    level = result.levels[0]
    assert result.status == "ok" and level.summary.tool_calls_valid_rate == 0.0
    assert all("(the output reached max_tokens)" in r.tool_calls_error for r in level.records)


def test_bakeoff_grades_each_engine(tmp_path: Path) -> None:
    def engine(name: str, *stub_args: str) -> str:
        port = free_port()
        command = shlex.join(stub_command("--ttft", "0.01", "--itl", "0.001", *stub_args, port=port))
        return f'[[engine]]\nname = "{name}"\ncommand = {json.dumps(command)}\nbase_url = "http://127.0.0.1:{port}"\n'

    config = tmp_path / "t.toml"
    config.write_text(
        '[workload]\nworkload = "tools"\ntool_choice = "auto"\nnum_prompts = 8\nconcurrency = [2]\nwarmup = 0\n\n'
        + engine("careful")
        + engine("sloppy", "--invalid-tools-every", "2", "--tools-differ-every", "4")
    )
    assert bakeoff.main([str(config), "--output", str(tmp_path / "out"), "--no-progress"]) == 0
    summaries = [e["levels"][0]["summary"] for e in read_results(tmp_path / "out")["engines"]]
    assert [(s["tool_calls_valid_rate"], s["tool_calls_agree_rate"]) for s in summaries] == [(1.0, 1.0), (0.5, 0.75)]
    report = (tmp_path / "out" / "report.md").read_text()
    assert "| metric | concurrency | careful | sloppy | sloppy / careful |" in report
    assert "| tool calls valid (higher is better) | 2 | 100.0% | 50.0% | 0.50x worse |" in report
    assert "| streamed = non-streamed calls (higher is better) | 2 | 100.0% | 75.0% | 0.75x worse |" in report
    assert "tools: 12 tools" in report and "tool_choice auto" in report
