"""Offline generation (what `pagoda generate` runs: LLM.generate on the main thread, the default
model) on a quiet machine and with one CPU kept busy by another process, with the default thread
settings and with `--threads 1`, alternated in rounds. Targets: busy default at least 0.5x quiet
default, and at least 0.9x busy `--threads 1`.

    python benchmarks/busy_core.py [--rounds 3] [--max-tokens 256] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

SETTINGS = {"default": None, "threads=1": 1}  # the engine's `threads`


def one_run(threads: int | None, max_tokens: int) -> None:
    """In a child process: load, warm up, then print the output tok/s of one greedy generation."""
    from pagoda import LLM, SamplingParams

    llm = LLM(threads=threads)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(["Warm up"], SamplingParams(temperature=0.0, max_tokens=8))
    start = time.perf_counter()
    out = llm.generate(["Tell me about the history of the Silk Road."], params)
    print(len(out[0].outputs[0].token_ids) / (time.perf_counter() - start))


def measure(threads: int | None, busy: bool, max_tokens: int) -> float:
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
    try:
        command = [sys.executable, __file__, "--child", str(threads or 0), "--max-tokens", str(max_tokens)]
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        return float(done.stdout.strip().splitlines()[-1])
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)  # threads; 0: default
    args = ap.parse_args()
    if args.child is not None:
        one_run(args.child or None, args.max_tokens)
        return
    runs: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for busy in (False, True):
            for name, flags in SETTINGS.items():
                key = f"{'busy' if busy else 'quiet'} {name}"
                runs.setdefault(key, []).append(measure(flags, busy, args.max_tokens))
                print(f"{key:18s} {runs[key][-1]:6.1f} tok/s", flush=True)
    median = {key: statistics.median(values) for key, values in runs.items()}
    ratios = {
        "busy default / quiet default (target >= 0.5)": median["busy default"] / median["quiet default"],
        "busy default / busy threads=1 (target >= 0.9)": median["busy default"] / median["busy threads=1"],
    }
    for key, value in {**median, **ratios}.items():
        print(f"{key:48s} {value:6.2f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"runs": runs, "median_tok_s": median, "ratios": ratios}, indent=1) + "\n")


if __name__ == "__main__":
    main()
