"""How fast `pagoda analyze` reads a large request log.

Generates a Pagoda request log (default: 100,000 requests averaging 1,000 prompt tokens and 100
output tokens, about half of the prompt tokens shared prefixes: one of 40 system prompts, and for
half the requests one of 200 documents, then a unique tail), runs `pagoda analyze LOG --json` on
it in a subprocess, and prints its wall and CPU time, its peak memory, and the load average (on a
shared machine, wall time says as much about the neighbours as about the analyzer).

    python benchmarks/analyze_scale.py [--requests 100000] [--log /tmp/analyze_scale.jsonl] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

VOCAB = 49152
SYSTEM_PROMPTS, SYSTEM_TOKENS = 40, (200, 600)  # mean 400
DOCUMENTS, DOCUMENT_TOKENS, DOCUMENT_SHARE = 200, (100, 300), 0.5  # mean 200, in half the requests
OUTPUT_TOKENS = (20, 180)  # mean 100


def generate(path: Path, requests: int, prompt_tokens: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    systems = [_ids(rng, rng.integers(*SYSTEM_TOKENS)) for _ in range(SYSTEM_PROMPTS)]
    documents = [_ids(rng, rng.integers(*DOCUMENT_TOKENS)) for _ in range(DOCUMENTS)]
    popularity = 1.0 / np.arange(1, SYSTEM_PROMPTS + 1)  # Zipf: a few system prompts dominate
    popularity /= popularity.sum()
    mean_shared = np.mean(SYSTEM_TOKENS) + DOCUMENT_SHARE * np.mean(DOCUMENT_TOKENS)
    unique_mean = prompt_tokens - mean_shared
    with path.open("w") as out:
        for i in range(requests):
            parts = [systems[rng.choice(SYSTEM_PROMPTS, p=popularity)]]
            if rng.random() < DOCUMENT_SHARE:
                parts.append(documents[rng.integers(DOCUMENTS)])
            parts.append(_ids(rng, rng.integers(1, 2 * unique_mean)))
            prompt = np.concatenate(parts)
            output = _ids(rng, rng.integers(*OUTPUT_TOKENS))
            out.write(_log_line(i, prompt, output) + "\n")


def _ids(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, VOCAB, size=int(n), dtype=np.int32)


def _log_line(i: int, prompt: np.ndarray, output: np.ndarray) -> str:
    # The layout `pagoda serve --request-log` writes, less cached_tokens (no server ran), with
    # the token lists spliced in as text.
    record = {
        "timestamp": 1_700_000_000.0 + i * 0.01,
        "endpoint": "/v1/chat/completions",
        "request_id": f"chatcmpl-{i:08d}",
        "body": {"model": "bench", "messages": [{"role": "user", "content": f"request {i}"}], "max_tokens": 256},
        "prompt_token_ids": "@P",
        "prompt_tokens": len(prompt),
        "output_tokens": len(output),
        "output_token_ids": "@O",
        "ttft_s": 0.05,
        "latency_s": 1.0,
    }
    text = json.dumps(record)
    text = text.replace('"@P"', "[" + ", ".join(map(str, prompt.tolist())) + "]")
    return text.replace('"@O"', "[" + ", ".join(map(str, output.tolist())) + "]")


@dataclass(frozen=True)
class Measurement:
    wall_s: float
    cpu_s: float  # user + system
    peak_mib: float
    report: dict


def run_analyzer(path: Path) -> Measurement:
    """Time, memory and the JSON report of `pagoda analyze --json` in a subprocess."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "pagoda.entrypoints.cli", "analyze", str(path), "--json"],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"pagoda analyze failed ({done.returncode}):\n{done.stderr}")
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return Measurement(seconds, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024, json.loads(done.stdout))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--prompt-tokens", type=int, default=1000, help="mean prompt length")
    parser.add_argument("--log", type=Path, default=Path("/tmp/analyze_scale.jsonl"))
    parser.add_argument("--keep", action="store_true", help="reuse the log at --log if it exists")
    args = parser.parse_args()
    if not (args.keep and args.log.exists()):
        start = time.perf_counter()
        generate(args.log, args.requests, args.prompt_tokens)
        print(f"generated {args.log} in {time.perf_counter() - start:.1f} s")
    load_before = os.getloadavg()[0]
    run = run_analyzer(args.log)
    report, size_mib = run.report, args.log.stat().st_size / 2**20
    unlimited = report["unlimited"]
    print(
        f"pagoda analyze: {report['requests']:,} requests, {report['prompt_tokens']:,} prompt tokens "
        f"(+{report['output_tokens']:,} output), {size_mib:,.0f} MiB log\n"
        f"  {run.wall_s:.1f} s wall, {run.cpu_s:.1f} s CPU, peak memory {run.peak_mib:,.0f} MiB "
        f"(load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after, {os.cpu_count()} CPUs)\n"
        f"  {report['distinct_tokens']:,} distinct tokens held\n"
        f"  reusable prompt tokens: {unlimited['token']['share']:.1%} (token), "
        f"{unlimited['block']['share']:.1%} ({report['block_size']}-token blocks)"
    )


if __name__ == "__main__":
    main()
