"""`pagoda bench`: benchmark one OpenAI-compatible server (see docs/bench.md)."""

from __future__ import annotations

import sys
from datetime import datetime
from urllib.parse import urlsplit

from pagoda.bench.datasets import load_workload
from pagoda.bench.errors import BenchError
from pagoda.bench.report import prepare_output, run_warnings, terminal_table, write_results
from pagoda.bench.run import EngineResult, execute
from pagoda.bench.settings import UsageError, build_parser, parse_settings
from pagoda.bench.vllm_results import write_vllm_results

PROG = "pagoda bench"


def main(argv: list[str]) -> int:
    try:
        settings = parse_settings(argv)
        workload = load_workload(settings.workload)
        if settings.output is not None:
            prepare_output(settings.output)
    except SystemExit as exc:  # --help
        return int(exc.code or 0)
    except UsageError as exc:
        print(f"{build_parser().format_usage()}{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except BenchError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    result = execute(settings, workload, urlsplit(settings.base_url).netloc)
    report(result, PROG)
    if settings.vllm_results is not None and result.levels:
        try:
            written = write_vllm_results(settings, result, datetime.now())
        except OSError as exc:
            print(f"{PROG}: error: cannot write the result JSON: {exc}", file=sys.stderr)
            return 2
        print(f"wrote {', '.join(str(path) for path in written)}")
    if settings.output is not None:
        try:
            written = write_results(settings.output, PROG, [PROG, *argv], settings, [result])
        except OSError as exc:
            print(f"{PROG}: error: cannot write results to {settings.output}: {exc}", file=sys.stderr)
            return 2
        print(f"wrote {', '.join(str(path) for path in written)}")
    return result.exit_code


def report(result: EngineResult, prog: str) -> None:
    if result.levels:
        print(terminal_table(result))
    for warning in run_warnings(result):
        print(f"{prog}: warning: {warning}", file=sys.stderr)
    if result.status == "failed":
        print(f"{prog}: error: {result.error}", file=sys.stderr)
    elif result.status == "interrupted":
        print(f"{prog}: interrupted; the requests that finished are kept", file=sys.stderr)
    elif result.status == "errors":
        failed = sum(level.summary.failed for level in result.levels)
        print(f"{prog}: {result.name}: {failed} requests failed (messages above and in the results)", file=sys.stderr)
