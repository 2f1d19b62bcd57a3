"""Results in every form: the terminal table, results.json, results.csv, report.md and report.html.

One schema serves `pagoda bench` (one engine) and `pagoda bakeoff` (several): results.json
holds the settings, the environment and, per engine, every level with its per-request records.
The files name no machine's paths: an absolute one is written relative to the report folder when
inside it, else as `.../NAME`.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import platform
import re
import shlex
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagoda import __version__
from pagoda.bench.datasets import LengthDist
from pagoda.bench.errors import BenchError
from pagoda.bench.metrics import RequestRecord, Stats
from pagoda.bench.run import EngineResult, LevelResult

SECRET_FIELDS = ("api_key",)
SECRET_OPTION = "--api-key"
SECRET_IN_TEXT = re.compile(rf"({SECRET_OPTION}(?:=|\s+))(\S+)")
# An absolute path in a string: not inside a URL (after "//host" or a word) and up to a space, quote or bracket.
ABSOLUTE_PATH = re.compile(r"(?<![\w.:/~-])/[^\s'\"`,;:=()\[\]{}<>|]+")


@dataclass(frozen=True)
class Metric:
    key: str  # the CSV column
    label: str
    value: Callable[[LevelResult], float | None]
    digits: int = 1
    percent: bool = False
    better: str | None = None  # "higher" or "lower"; None where neither is (counts, hit rates)


def _summary(name: str) -> Callable[[LevelResult], float | None]:
    return lambda level: getattr(level.summary, name)


def _latency(name: str, stat: str) -> Callable[[LevelResult], float | None]:
    def value(level: LevelResult) -> float | None:
        stats: Stats | None = getattr(level.summary, name)
        return None if stats is None else getattr(stats, stat) * 1000

    return value


LATENCIES = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2e", "E2E latency"))
STATS = ("mean", "median", "p95", "p99")
METRICS = (
    Metric("completed", "completed requests", _summary("completed"), 0),
    Metric("failed", "failed requests", _summary("failed"), 0, better="lower"),
    Metric(
        "schema_valid_rate", "structured outputs valid", _summary("schema_valid_rate"), percent=True, better="higher"
    ),
    Metric(
        "tool_calls_valid_rate", "tool calls valid", _summary("tool_calls_valid_rate"), percent=True, better="higher"
    ),
    Metric(
        "tool_calls_agree_rate",
        "streamed = non-streamed calls",
        _summary("tool_calls_agree_rate"),
        percent=True,
        better="higher",
    ),
    Metric("duration_s", "duration (s)", _summary("duration_s"), 2),
    Metric("input_tokens", "input tokens", _summary("input_tokens"), 0),
    Metric("output_tokens", "output tokens", _summary("output_tokens"), 0),
    Metric("request_throughput", "requests/s", _summary("request_throughput"), 3, better="higher"),
    Metric("output_throughput", "output tokens/s", _summary("output_throughput"), better="higher"),
    Metric("total_token_throughput", "total tokens/s", _summary("total_token_throughput"), better="higher"),
    *(
        Metric(
            f"{name}_{stat}_ms",
            f"{label} {'p50' if stat == 'median' else stat} (ms)",
            _latency(name, stat),
            better="lower",
        )
        for name, label in LATENCIES
        for stat in STATS
    ),
    Metric("goodput", "goodput (requests/s)", _summary("goodput"), 3, better="higher"),
    Metric(
        "prefix_cache_hit_rate",
        "prefix cache hit rate",
        lambda level: level.prefix_cache.hit_rate if level.prefix_cache else None,
        percent=True,
    ),
)
BY_KEY = {metric.key: metric for metric in METRICS}
# A measured hit rate this far above the workload's ideal share means the cache was warm before the run.
WARM_CACHE_MARGIN = 0.05
# The metrics report.md compares engine by engine.
REPORT_KEYS = (
    "schema_valid_rate",
    "tool_calls_valid_rate",
    "tool_calls_agree_rate",
    "output_throughput",
    "request_throughput",
    "total_token_throughput",
    "ttft_median_ms",
    "ttft_p95_ms",
    "ttft_p99_ms",
    "tpot_median_ms",
    "tpot_p99_ms",
    "itl_median_ms",
    "itl_p99_ms",
    "e2e_median_ms",
    "e2e_p99_ms",
    "goodput",
    "failed",
    "prefix_cache_hit_rate",
)


def fmt(metric: Metric, value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.1%}" if metric.percent else f"{value:,.{metric.digits}f}"


def terminal_table(result: EngineResult) -> str:
    """Metrics as rows, concurrency levels as columns."""
    header = ["", *_level_names(result)]
    rows = [header]
    for metric in METRICS:
        values = [metric.value(level) for level in result.levels]
        if any(v is not None for v in values):
            rows.append([metric.label, *(fmt(metric, v) for v in values)])
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [
        "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
        for row in rows
    ]
    title = f"{result.name}: {result.model or '?'} at {result.base_url}"
    return "\n".join([title, *lines])


def run_warnings(result: EngineResult) -> list[str]:
    """What makes a run's figures untrustworthy: a prefix cache warm from an earlier run, or a
    machine busier than its cores while it ran."""
    warnings = []
    ideal = result.ideal_prefix_share
    for level in result.levels:
        hit_rate = level.prefix_cache.hit_rate if level.prefix_cache else None
        if ideal is not None and hit_rate is not None and hit_rate > ideal + WARM_CACHE_MARGIN:
            warnings.append(
                f"{result.name}: at concurrency {level.concurrency} the prefix cache hit {hit_rate:.1%} of prompt "
                f"tokens, more than the workload's {ideal:.1%}: it held prompts from an earlier run "
                "(restart the server, pass --reset-prefix-cache, or change --seed)"
            )
    cores = os.cpu_count() or 1
    if result.peak_load_average is not None and result.peak_load_average > cores:
        warnings.append(
            f"{result.name}: the load average reached {result.peak_load_average:.1f} on {cores} CPUs during the run: "
            "other work competed with the server and the client, so the figures understate the machine"
        )
    return warnings


def _level_names(result: EngineResult) -> list[str]:
    bound = "c={}" if result.in_flight_bound else "no bound"
    return [bound.format(level.concurrency) + (" (cut)" if level.interrupted else "") for level in result.levels]


def environment() -> dict[str, Any]:
    return {
        "pagoda": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "hostname": socket.gethostname(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def plain(value: Any) -> Any:
    """JSON-ready data: dataclasses as dicts, paths as strings, infinities as "inf", and API keys
    hidden, whether a field or an option in a command line."""
    if isinstance(value, LengthDist):
        return str(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        data = {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
        if isinstance(value, RequestRecord):
            data["tpot_s"] = value.tpot_s
        return {k: ("***" if k in SECRET_FIELDS and v else v) for k, v in data.items()}
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [plain(v) for v in value]
        return _hide_option_values(items) if all(isinstance(v, str) for v in items) else items
    if isinstance(value, str):
        return SECRET_IN_TEXT.sub(r"\1***", value)
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def _hide_option_values(argv: list[str]) -> list[str]:
    return ["***" if i and argv[i - 1] == SECRET_OPTION else arg for i, arg in enumerate(argv)]


def results_json(tool: str, argv: Sequence[str], settings: Any, results: Sequence[EngineResult]) -> dict[str, Any]:
    return {
        "tool": tool,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": plain(list(argv)),
        "environment": environment(),
        "settings": plain(settings),
        "engines": [plain(result) | {"exit_code": result.exit_code} for result in results],
    }


def csv_rows(results: Sequence[EngineResult]) -> list[dict[str, Any]]:
    rows = []
    for result in results:
        for level in result.levels:
            row: dict[str, Any] = {
                "engine": result.name,
                "concurrency": level.concurrency if result.in_flight_bound else "",  # empty: no bound
                "interrupted": level.interrupted,
            }
            row |= {metric.key: metric.value(level) for metric in METRICS}
            rows.append(row)
    return rows


def prepare_output(folder: Path) -> None:
    """Make the results folder before the run, so that one that cannot be written fails at once,
    not after a long run whose results would then be lost."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if not os.access(folder, os.W_OK):
            raise PermissionError(f"{folder} is not writable")
    except OSError as exc:
        raise BenchError(f"cannot write results to {folder}: {exc}") from None


def write_results(
    folder: Path,
    tool: str,
    argv: Sequence[str],
    settings: Any,
    results: Sequence[EngineResult],
) -> list[Path]:
    """Write results.json, results.csv, report.md, the plots and report.html (the
    markdown and plots in one file, html_report.py); returns the files written."""
    from pagoda.bench.html_report import write_report_html
    from pagoda.bench.plots import write_plots

    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / "results.json", folder / "results.csv", folder / "report.md"]
    data = _neutral(results_json(tool, argv, settings, results), folder)
    paths[0].write_text(json.dumps(data, indent=1) + "\n")
    with paths[1].open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=["engine", "concurrency", "interrupted", *BY_KEY])
        writer.writeheader()
        writer.writerows(csv_rows(results))
    plots = write_plots(folder, results)
    paths[2].write_text(machine_neutral(markdown(tool, argv, settings, results, [p.name for p in plots]), folder))
    return paths + plots + [write_report_html(folder, f"{tool} report")]


def machine_neutral(text: str, folder: Path) -> str:
    """`text` with each absolute path to something on this machine rewritten, so that a report
    shows no machine's layout (home, temp or checkout folders): relative to the report `folder`
    when inside it, else `.../` and its last part. Other absolute paths that name nothing here (API
    routes in error messages) stay as they are."""
    root = folder.resolve()

    def rewrite(match: re.Match[str]) -> str:
        path = Path(match.group())
        resolved = path.resolve()
        if resolved.is_relative_to(root):  # a file to come (a server log), too
            return str(resolved.relative_to(root))
        return f".../{path.name}" if path.exists() else match.group()

    return ABSOLUTE_PATH.sub(rewrite, text)


def _neutral(data: Any, folder: Path) -> Any:
    """`machine_neutral` over every string of JSON-ready data."""
    if isinstance(data, str):
        return machine_neutral(data, folder)
    if isinstance(data, dict):
        return {key: _neutral(value, folder) for key, value in data.items()}
    if isinstance(data, list):
        return [_neutral(value, folder) for value in data]
    return data


def markdown(
    tool: str, argv: Sequence[str], settings: Any, results: Sequence[EngineResult], plots: Sequence[str]
) -> str:
    """Settings, engines, then only the sections something was measured for."""
    program, *args = plain(list(argv))  # the tool's name ("pagoda bench"), then its arguments quoted for a shell
    command = f"{program} {shlex.join(args)}".strip()
    lines = [f"# {tool} report", "", f"Command: `{command}`", "", "## Settings", ""]
    lines += [
        f"- {key}: " + ("(default)" if value is None else f"`{value}`") for key, value in _flat(plain(settings)).items()
    ]
    lines += ["", "## Engines", ""]
    for result in results:
        status = result.status + (f": {result.error}" if result.error else "")
        lines.append(f"- **{result.name}**: model `{result.model}` at {result.base_url}; {status}")
        if result.launch_command:
            lines.append(f"  - launch: `{result.launch_command}`")
    warnings = [warning for result in results for warning in run_warnings(result)]
    sections = [
        _section("Warnings", [f"- {warning}" for warning in warnings]),
        _section("Workload", sorted({f"- {r.workload}" for r in results if r.workload})),
        _section("Cold start", _cold_start_table(results)),
        _section("Peak memory", _memory_table(results)),
        *(_section(f"Results: {r.name}", level_table(r)) for r in results if r.levels),
        _section("Side by side", side_by_side(results)),
        _section("Plots", [f"![{name}]({name})" for name in plots]),
    ]
    return "\n".join(lines + [line for section in sections for line in section] + [""])


def _section(title: str, body: list[str]) -> list[str]:
    return ["", f"## {title}", "", *body] if body else []


def level_table(result: EngineResult) -> list[str]:
    """One engine's report metrics by concurrency level; rows it did not measure left out."""
    header = ["metric", *_level_names(result)]
    lines = [_row(header), _row(["---"] * len(header))]
    for metric in (BY_KEY[key] for key in REPORT_KEYS):
        values = [metric.value(level) for level in result.levels]
        if any(v is not None for v in values):
            lines.append(_row([_label(metric), *(fmt(metric, v) for v in values)]))
    return lines


def side_by_side(results: Sequence[EngineResult]) -> list[str]:
    """Engines side by side per metric and concurrency level, with each engine's ratio to the
    first saying whether it is better or worse; empty unless two engines measured something. A
    level an interrupt cut short is marked "(cut)", and no ratio stands on one."""
    results = [r for r in results if r.levels]
    if len(results) < 2:
        return []
    names = [r.name for r in results]
    header = ["metric", "concurrency", *names, *(f"{n} / {names[0]}" for n in names[1:])]
    lines = [_row(header), _row(["---"] * len(header))]
    levels = sorted({level.concurrency for r in results for level in r.levels})
    for metric in (BY_KEY[key] for key in REPORT_KEYS):
        if _unmeasured(metric, results):
            continue
        for concurrency in levels:
            at = [next((lv for lv in r.levels if lv.concurrency == concurrency), None) for r in results]
            values = [None if level is None else metric.value(level) for level in at]
            cut = [level is not None and level.interrupted for level in at]
            shown = [fmt(metric, v) + (" (cut)" if c else "") for v, c in zip(values, cut)]
            ratios = ["-" if c or cut[0] else _ratio(metric, v, values[0]) for v, c in zip(values[1:], cut[1:])]
            lines.append(_row([_label(metric), str(concurrency), *shown, *ratios]))
    return lines


def _label(metric: Metric) -> str:
    return metric.label + (f" ({metric.better} is better)" if metric.better else "")


def _ratio(metric: Metric, value: float | None, first: float | None) -> str:
    """`value / first`, and whether that is better or worse by the metric's direction (against a
    first of 0, which no ratio stands on, only that: 4 failed requests against none are worse)."""
    if value is not None and first == 0 and value != 0 and metric.better is not None:
        return "worse" if (value > 0) == (metric.better == "lower") else "better"
    if value is None or not first:
        return "-"
    ratio = value / first
    if metric.better is None or math.isclose(ratio, 1.0, rel_tol=0.005):
        return f"{ratio:.2f}x"
    better = (ratio > 1) == (metric.better == "higher")
    return f"{ratio:.2f}x {'better' if better else 'worse'}"


def _flat(data: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(data, dict):
        return {prefix: data}
    out: dict[str, Any] = {}
    for key, value in data.items():
        out |= _flat(value, f"{prefix}{key}" if not prefix else f"{prefix}.{key}")
    return out


def _unmeasured(metric: Metric, results: Sequence[EngineResult]) -> bool:
    return all(metric.value(level) is None for r in results for level in r.levels)


def _cold_start_table(results: Sequence[EngineResult]) -> list[str]:
    """Empty when no engine was launched."""
    if all(r.cold_start is None for r in results):
        return []
    lines = [_row(["engine", "answering (s)", "first request done (s)"]), _row(["---"] * 3)]
    for r in results:
        cs = r.cold_start
        lines.append(_row([r.name, _num(cs and cs.ready_s), _num(cs and cs.first_request_s)]))
    return lines


def _memory_table(results: Sequence[EngineResult]) -> list[str]:
    """Empty when no engine's memory was sampled."""
    if all(r.memory is None or r.memory.rss_mib is None and r.memory.gpu_mib is None for r in results):
        return []
    header = ["engine", "peak RSS (MiB)", "peak GPU memory in use (MiB)", "GPU memory at start (MiB)"]
    lines = [_row(header), _row(["---"] * 4)]
    for r in results:
        m = r.memory
        lines.append(
            _row([r.name, _num(m and m.rss_mib, 0), _num(m and m.gpu_mib, 0), _num(m and m.gpu_baseline_mib, 0)])
        )
    return lines


def _num(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _row(cells: Sequence[str]) -> str:
    return "| " + " | ".join(cells) + " |"
