"""Two replicas behind SGLang Model Gateway, round-robin against cache-aware, with the analyzer's
forecast beside the measurement (issue 20).

For each policy: `pagoda serve --data-parallel-size 2 --threads 2 --router-policy P` (one compute
thread per replica), a shared-prefix workload from `pagoda bench` (an odd number of groups, so
that round-robin cannot keep a group on one replica by accident), and the replicas' request logs.
The measured hit rate is the replicas' own cached tokens over prompt tokens (from their logs: the
gateway's /metrics are its own); TTFT and throughput are `pagoda bench`'s. The forecast is
`pagoda analyze --replicas 2` of the requests the cache-aware run sent.

    python benchmarks/scale_out.py                       # the issue's setting, on a quiet machine
    python benchmarks/scale_out.py --groups 3 --prompts-per-group 2 --system-prompt-len 64 \\
        --output-len 4 --out /tmp/scale_out_quick       # a quick end-to-end check
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
from pathlib import Path

POLICIES = {"round_robin": "round-robin", "cache_aware": "cache-aware"}  # smg's name: the analyzer's


def main() -> int:
    args = parse_args()
    out = Path(args.out)
    rows = {}
    for policy in POLICIES:
        rows[policy] = run_policy(args, policy, out / policy)
    log = merged_log(out / "cache_aware", out / "requests.jsonl")
    forecast = analyze(args, log)
    report = render(args, rows, forecast)
    (out / "report.md").write_text(report)
    print(report)
    return 0


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: Pagoda's default model")
    p.add_argument("--port", type=int, default=8130)
    p.add_argument("--groups", type=int, default=15)
    p.add_argument("--prompts-per-group", type=int, default=8)
    p.add_argument("--system-prompt-len", type=int, default=1024)
    p.add_argument("--question-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--out", default="benchmarks/results/scale_out")
    return p.parse_args()


def run_policy(args: argparse.Namespace, policy: str, folder: Path) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("requests*.jsonl"):
        old.unlink()
    serve = [
        *("pagoda serve", args.model or "", f"--port {args.port} --data-parallel-size 2 --threads 2"),
        f"--router-policy {policy} --request-log {folder / 'requests.jsonl'} --disable-log-stats",
    ]
    bench = [
        *(sys.executable, "-m", "pagoda.entrypoints.cli", "bench", "--base-url", f"http://127.0.0.1:{args.port}"),
        *("--launch", " ".join(part for part in serve if part), "--workload", "shared-prefix", "--endpoint", "chat"),
        *("--groups", str(args.groups), "--prompts-per-group", str(args.prompts_per_group)),
        *("--system-prompt-len", str(args.system_prompt_len), "--question-len", str(args.question_len)),
        *("--output-len", str(args.output_len), "--concurrency", str(args.concurrency), "--warmup", "0"),
        *("--tokenizer", args.model or "default", "--output", str(folder), "--no-progress"),
    ]
    subprocess.run(bench, check=True)
    with (folder / "results.csv").open() as handle:
        bench_row = next(csv.DictReader(handle))
    prompt = cached = 0
    for log in folder.glob("requests.*.jsonl"):
        for line in log.read_text().splitlines():
            record = json.loads(line)
            prompt += record["prompt_tokens"]
            cached += record["cached_tokens"]
    return {**bench_row, "hit_rate": cached / prompt if prompt else 0.0, "cached": cached, "prompt": prompt}


def merged_log(folder: Path, target: Path) -> Path:
    """The replicas' request logs as one, in finishing order (the analyzer restores arrival order)."""
    records = [json.loads(line) for log in folder.glob("requests.*.jsonl") for line in log.read_text().splitlines()]
    records.sort(key=lambda record: record["timestamp"])
    target.write_text("".join(json.dumps(record) + "\n" for record in records))
    return target


def analyze(args: argparse.Namespace, log: Path) -> dict:
    command = [sys.executable, "-m", "pagoda.entrypoints.cli", "analyze", str(log), "--replicas", "2", "--json"]
    if args.model:
        command += ["--tokenizer", args.model]
    result = subprocess.run(command, check=True, capture_output=True, text=True)
    report = json.loads(result.stdout)
    return {route["policy"]: route for route in report["routing"]}


def render(args: argparse.Namespace, rows: dict, forecast: dict) -> str:
    lines = [
        "# Two replicas behind SGLang Model Gateway: round-robin against cache-aware",
        "",
        f"Shared-prefix chat workload: {args.groups} groups x {args.prompts_per_group} requests, "
        f"{args.system_prompt_len}-token system prompts, {args.question_len}-token questions, "
        f"{args.output_len} output tokens, concurrency {args.concurrency}; "
        f"`pagoda serve --data-parallel-size 2 --threads 2` (one thread per replica).",
        "",
        "| policy | hit rate (measured) | hit rate (forecast) | requests per replica (forecast) "
        "| TTFT p50 (ms) | TTFT p95 (ms) | output tokens/s | requests/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for policy, row in rows.items():
        route = forecast[POLICIES[policy]]
        predicted = route["points"][0]["reused"]["share"]
        spread = "/".join(map(str, route["requests_per_replica"]))
        lines.append(
            f"| {policy} | {row['hit_rate']:.1%} | {predicted:.1%} | {spread} | {float(row['ttft_median_ms']):.0f} "
            f"| {float(row['ttft_p95_ms']):.0f} | {float(row['output_throughput']):.1f} "
            f"| {float(row['request_throughput']):.3f} |"
        )
    lines += [
        "",
        "The forecast replays the requests the cache-aware run sent (`pagoda analyze --replicas 2`, "
        "unlimited caches, requests in flight as logged); measured hit rate = the replicas' cached "
        "tokens / prompt tokens, from their request logs.",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
