"""Report files: what they say about the machine they were written on."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from pagoda.bench.metrics import RequestRecord, summarize
from pagoda.bench.plots import subtitle
from pagoda.bench.report import machine_neutral, markdown, side_by_side
from pagoda.bench.run import EngineResult, LevelResult


def test_absolute_paths_become_relative_to_the_report_or_lose_their_folders(tmp_path: Path) -> None:
    folder = tmp_path / "report"
    (folder / "logs").mkdir(parents=True)
    dataset = tmp_path / "data" / "d.jsonl"
    dataset.parent.mkdir()
    dataset.touch()
    text = f"pagoda bench --output {folder} --server-log={folder / 'logs'} --dataset {dataset} `{dataset.parent}`"
    assert machine_neutral(text, folder) == "pagoda bench --output . --server-log=logs --dataset .../d.jsonl `.../data`"


def test_urls_routes_and_relative_paths_stay(tmp_path: Path) -> None:
    text = "HTTP 404: /v1/chat/completions at http://127.0.0.1:8000/v1/models; results/x, ./y, tok/s, ~/z"
    assert machine_neutral(text, tmp_path) == text


def level(concurrency: int, throughput: float, ttft_s: float) -> LevelResult:
    record = RequestRecord(0, 0, 0, 0.0, ttft_s, ttft_s + 0.1, (0.1,), 5, 2, "usage")
    summary = dataclasses.replace(summarize([record], 1.0, None), output_throughput=throughput)
    return LevelResult(concurrency, "level0", summary, None, (record,))


def engine(name: str, throughput: float, ttft_s: float) -> EngineResult:
    result = EngineResult(name, "http://x", model="m-1", workload="random: ...", workload_name="random, 8 in / 4 out")
    result.levels = [level(1, throughput, ttft_s)]
    return result


def test_report_has_a_table_per_engine_and_no_empty_sections() -> None:
    report = markdown("pagoda bench", ["pagoda", "bench"], {}, [engine("a", 100.0, 0.5)], [])
    assert "## Results: a\n\n| metric | c=1 |\n| --- | --- |\n| output tokens/s (higher is better) | 100.0 |" in report
    assert "| TTFT p50 (ms) (lower is better) | 500.0 |" in report
    for empty in ("## Cold start", "## Peak memory", "## Side by side", "## Plots", "## Warnings", "structured"):
        assert empty not in report


def test_side_by_side_ratios_say_which_engine_is_better() -> None:
    rows = side_by_side([engine("a", 100.0, 0.5), engine("b", 50.0, 0.25), engine("c", 100.0, 0.5)])
    assert rows[0] == "| metric | concurrency | a | b | c | b / a | c / a |"
    assert "| output tokens/s (higher is better) | 1 | 100.0 | 50.0 | 100.0 | 0.50x worse | 1.00x |" in rows
    assert "| TTFT p50 (ms) (lower is better) | 1 | 500.0 | 250.0 | 500.0 | 0.50x better | 1.00x |" in rows
    assert side_by_side([engine("a", 100.0, 0.5)]) == []


def test_against_none_failed_an_engines_failures_are_worse() -> None:
    clean, failing = engine("a", 100.0, 0.5), engine("b", 100.0, 0.5)
    failing.levels = [
        dataclasses.replace(failing.levels[0], summary=dataclasses.replace(failing.levels[0].summary, failed=4))
    ]
    rows = [row for row in side_by_side([clean, failing]) if row.startswith("| failed requests")]
    assert rows == ["| failed requests (lower is better) | 1 | 0 | 4 | worse |"], rows


def test_side_by_side_marks_a_cut_level_and_compares_no_ratio_on_it() -> None:
    whole, cut = engine("a", 100.0, 0.5), engine("b", 50.0, 0.25)
    cut.levels = [dataclasses.replace(cut.levels[0], interrupted=True)]
    rows = side_by_side([whole, cut])
    assert "| output tokens/s (higher is better) | 1 | 100.0 | 50.0 (cut) | - |" in rows
    assert "| output tokens/s (higher is better) | 1 | 50.0 (cut) | 100.0 | - |" in side_by_side([cut, whole])


def test_plot_titles_name_the_model_and_the_workload() -> None:
    assert subtitle([engine("a", 1.0, 0.1), engine("b", 1.0, 0.1)]) == "m-1; random, 8 in / 4 out"
