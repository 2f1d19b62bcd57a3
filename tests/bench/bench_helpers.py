"""Helpers shared by the benchmark's tests."""

from __future__ import annotations

import json
import sys
from pathlib import Path

STUB = Path(__file__).with_name("bench_stub_server.py")


def stub_command(*args: str, port: int = 0) -> list[str]:
    return [sys.executable, str(STUB), "--port", str(port), *args]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def read_results(folder: Path) -> dict:
    return json.loads((folder / "results.json").read_text())


def run_bench(base_url: str, *args: str):
    """`pagoda bench` in-process up to its EngineResult: no report files, no plots."""
    from pagoda.bench.datasets import load_workload
    from pagoda.bench.run import execute
    from pagoda.bench.settings import parse_settings

    settings = parse_settings(["--base-url", base_url, "--no-progress", "--warmup", "0", *args])
    return execute(settings, load_workload(settings.workload), "stub")
