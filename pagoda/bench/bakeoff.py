"""`pagoda bakeoff CONFIG.toml`: several engines, one after another, on the same workload.

The config's [workload] table holds `pagoda bench` options (underscores or dashes); each
[[engine]] names a launch command, a base URL and optionally a model, an environment and a
ready timeout. Each engine is started, timed until it answers, warmed up, swept with the same
seeded prompts, and stopped before the next starts. With `rounds` (top level, or --rounds) the
whole list runs that many times in turn, each engine-round named NAME-rR, so that a figure a
single run leaves noisy (a p50 between two clusters of latencies) can be pooled or compared across
rounds that met the same machine minutes; an engine with its own `rounds` runs in the first that
many only. The report folder is rewritten after every engine, so a failure or Ctrl-C keeps the
engines measured so far. See docs/bench.md.
"""

from __future__ import annotations

import json
import re
import shlex
import sys
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagoda.bench.cli import report
from pagoda.bench.datasets import load_workload
from pagoda.bench.errors import BenchError
from pagoda.bench.launcher import missing_executable
from pagoda.bench.report import plain, prepare_output, side_by_side, write_results
from pagoda.bench.run import EngineResult, execute
from pagoda.bench.settings import BenchSettings, parse_settings
from pagoda.entrypoints.parsing import Parser

PROG = "pagoda bakeoff"
ENGINE_KEYS = {"name", "command", "base_url", "model", "env", "ready_timeout", "api_key", "metrics_url", "rounds"}
# Options that differ per engine or per run, so a shared [workload] table must not set them.
NOT_WORKLOAD = {
    "base_url",
    "model",
    "api_key",
    "launch",
    "launch_env",
    "launch_timeout",
    "server_log",
    "server_pid",
    "metrics_url",
    "output",
    "result_dir",
    "save_result",
    "result_filename",
    "append_result",
    "save_detailed",
    "label",
    "metadata",
    "host",
    "port",
    "header",
    "served_model_name",
    "ready_check_timeout_sec",
}
PER_ENGINE_FIELDS = NOT_WORKLOAD | {"launch"}  # of BenchSettings, left out of the shared settings


@dataclass(frozen=True)
class Engine:
    name: str
    settings: BenchSettings


@dataclass(frozen=True)
class Bakeoff:
    config: Path
    output: Path
    workload_table: dict[str, Any]
    engines: tuple[Engine, ...]


def main(argv: list[str]) -> int:
    parser = Parser(prog=PROG, description="Run several engines one after another and compare them.")
    parser.add_argument("config", type=Path, help="a TOML file: [workload] and [[engine]] tables (see examples/)")
    parser.add_argument("--output", type=Path, metavar="DIR", help="report folder (default: the config's `output`)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument(
        "--rounds",
        type=int,
        metavar="N",
        help="run the engine list N times in turn (default: the config's `rounds`, else 1)",
    )
    args = parser.parse_args(argv)
    try:
        bakeoff = load_config(args.config, args.output, args.no_progress, args.rounds)
        workload = load_workload(bakeoff.engines[0].settings.workload)
        prepare_output(bakeoff.output)
    except BenchError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    _warn_missing_commands(bakeoff)
    results: list[EngineResult] = []
    for engine in bakeoff.engines:
        print(f"== {engine.name} ==", file=sys.stderr, flush=True)
        results.append(execute(engine.settings, workload, engine.name))
        report(results[-1], PROG)
        _write(bakeoff, argv, results)
        if results[-1].status == "interrupted":
            break
    if table := side_by_side(results):
        print("\n".join(["", "side by side:", *table]))
    return _exit_code(results, len(bakeoff.engines))


def load_config(path: Path, output: Path | None, no_progress: bool = False, rounds: int | None = None) -> Bakeoff:
    """Parse and check the whole config, every engine's options included, before anything runs.
    The engines come in the order they run: with rounds, the whole list once per round."""
    try:
        config = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise BenchError(f"cannot read {path}: {exc.strerror}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise BenchError(f"{path}: not valid TOML: {exc}") from None
    unknown = set(config) - {"workload", "engine", "output", "rounds"}
    if unknown:
        raise BenchError(
            f"{path}: unknown top-level keys {sorted(unknown)}; expected [workload], [[engine]], output, rounds"
        )
    rounds = _rounds(f"{path}: rounds", config.get("rounds", 1) if rounds is None else rounds)
    table = config.get("workload", {})
    if not isinstance(table, dict):
        raise BenchError(f"{path}: [workload] must be a table")
    entries = config.get("engine")
    if not isinstance(entries, list) or not entries or not all(isinstance(e, dict) for e in entries):
        raise BenchError(f"{path}: list the engines as [[engine]] tables")
    folder = output or Path(config.get("output") or f"bakeoff-{path.stem}-{time.strftime('%Y%m%d-%H%M%S')}")
    workload_argv = _workload_options(path, table) + (["--no-progress"] if no_progress else [])
    checked = tuple(_engine(path, number, entry, workload_argv, folder) for number, entry in enumerate(entries, 1))
    names = [engine.name for engine in checked]
    if len(set(names)) != len(names):
        raise BenchError(f"{path}: engine names must differ, got {names}")
    own = [
        _rounds(f"{path}: engine {number} ({name!r}): rounds", entry.get("rounds", rounds))
        for number, (name, entry) in enumerate(zip(names, entries), 1)
    ]
    if rounds == 1:
        return Bakeoff(path, folder, table, checked)
    engines = tuple(
        _engine(path, number, entry, workload_argv, folder, f"{name}-r{r}")
        for r in range(1, rounds + 1)
        for number, (name, entry) in enumerate(zip(names, entries), 1)
        if r <= own[number - 1]
    )
    return Bakeoff(path, folder, table, engines)


def _rounds(where: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BenchError(f"{where} must be an integer >= 1, got {value!r}")
    return value


def _workload_options(path: Path, table: dict[str, Any]) -> list[str]:
    keys = {key.replace("-", "_") for key in table}
    if keys & NOT_WORKLOAD:
        raise BenchError(f"{path}: [workload] cannot set {sorted(keys & NOT_WORKLOAD)}: they belong to each [[engine]]")
    argv = _as_options(table)
    try:
        parse_settings(argv)
    except BenchError as exc:
        raise BenchError(f"{path}: [workload]: {exc}") from None
    return argv


def _engine(
    path: Path, number: int, entry: dict[str, Any], workload_argv: list[str], folder: Path, name: str | None = None
) -> Engine:
    """Engine `number` of the config; `name`: its name in this round (default: the config's)."""
    where = f"{path}: engine {number}" + (f" ({entry['name']!r})" if "name" in entry else "")
    unknown = set(entry) - ENGINE_KEYS
    if unknown:
        raise BenchError(f"{where}: unknown keys {sorted(unknown)}; expected some of {sorted(ENGINE_KEYS)}")
    for key in ("name", "command", "base_url"):
        if not entry.get(key):
            raise BenchError(f"{where}: missing {key!r}")
    name = name or str(entry["name"])
    command = entry["command"]
    if not isinstance(command, (str, list)):
        raise BenchError(f"{where}: command must be a string or a list of strings, got {command!r}")
    command = shlex.join(map(str, command)) if isinstance(command, list) else str(command)
    env = entry.get("env", {})
    if not isinstance(env, dict):
        raise BenchError(f"{where}: env must be a table of strings")
    options = {k: entry[k] for k in ("base_url", "model", "api_key", "metrics_url") if k in entry}
    argv = [
        *workload_argv,
        *_as_options(options),
        f"--launch={command}",
        f"--server-log={folder / 'logs' / (_file_name(name) + '.log')}",
        *(f"--launch-env={key}={value}" for key, value in env.items()),
    ]
    if "ready_timeout" in entry:
        argv.append(f"--launch-timeout={entry['ready_timeout']}")
    try:
        return Engine(name, parse_settings(argv))
    except BenchError as exc:
        raise BenchError(f"{where}: {exc}") from None


def _as_options(table: dict[str, Any]) -> list[str]:
    """TOML values as `pagoda bench` options: true is a bare flag, false its --no- form, lists
    are comma-joined, tables JSON (for --extra-body)."""
    argv = []
    for key, value in table.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else f"--no-{flag[2:]}")
        elif isinstance(value, list):
            argv.append(f"{flag}={','.join(map(str, value))}")
        elif isinstance(value, dict):
            argv.append(f"{flag}={json.dumps(value)}")
        else:
            argv.append(f"{flag}={value}")
    return argv


def _file_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)


def _warn_missing_commands(bakeoff: Bakeoff) -> None:
    for engine in bakeoff.engines:
        launch = engine.settings.launch
        program = missing_executable(launch.command) if launch else None
        if program:
            print(
                f"{PROG}: warning: engine {engine.name!r}: command not found: {program}; it will fail", file=sys.stderr
            )


def _write(bakeoff: Bakeoff, argv: list[str], results: list[EngineResult]) -> None:
    settings = {
        "config": bakeoff.config,
        "workload": bakeoff.workload_table,
        "engines": [
            {
                "name": e.name,
                "launch": shlex.join(e.settings.launch.command) if e.settings.launch else None,
                "base_url": e.settings.base_url,
                "model": e.settings.model,
            }
            for e in bakeoff.engines
        ],
        "resolved": {k: v for k, v in plain(bakeoff.engines[0].settings).items() if k not in PER_ENGINE_FIELDS},
    }
    try:
        written = write_results(bakeoff.output, PROG, [PROG, *argv], settings, results)
    except OSError as exc:
        print(f"{PROG}: error: cannot write the report to {bakeoff.output}: {exc}", file=sys.stderr)
        return
    print(f"wrote {', '.join(str(path) for path in written)}", file=sys.stderr)


def _exit_code(results: list[EngineResult], planned: int) -> int:
    if any(r.status == "interrupted" for r in results):
        return 130
    return 0 if len(results) == planned and all(r.status == "ok" for r in results) else 1
