"""Report files: what they say about the machine they were written on."""

from __future__ import annotations

from pathlib import Path

from pagoda.bench.report import machine_neutral


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
