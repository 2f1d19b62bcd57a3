"""What the web console's live feed costs the engine: output tok/s at one concurrency with a 1 Hz
HTTP client polling the console's feed (as an open dashboard does) against none, in alternating
pairs (none first in even pairs, polled first in odd ones) after one unrecorded run, each run the
same `pagoda bench` workload with the prefix cache reset before it.

    python benchmarks/console_cost.py                        # launches `pagoda serve` (default model)
    python benchmarks/console_cost.py --base-url http://127.0.0.1:8000 --api-key KEY
    python benchmarks/console_cost.py --pairs 1 --num-prompts 8 --output-len 8   # a quick check

Writes results/console_cost.json (each run's tok/s, the polls made, the per-pair ratios) and
prints the ratios; the target is a mean ratio (polled / none) above 0.98. The poller runs in this
process, not in a browser: a browser on the same cores would measure the browser, not the server.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
POLL_S = 1.0


def main() -> int:
    args = parse_args()
    server = launch(args) if args.base_url is None else None
    base_url = args.base_url or f"http://127.0.0.1:{args.port}"
    try:
        wait_ready(base_url, args.api_key)
        run_once(args, base_url, polled=False)  # unrecorded: the first run after a start is slower
        runs = []
        for pair in range(args.pairs):
            order = (False, True) if pair % 2 == 0 else (True, False)
            for polled in order:
                runs.append({"pair": pair, "polled": polled, **run_once(args, base_url, polled)})
                label = "polled" if polled else "none"
                print(f"pair {pair} {label:>6}: {runs[-1]['output_tok_s']:.1f} tok/s", flush=True)
    finally:
        if server is not None:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=60)
    return report(args, runs)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", help="a running server (default: launch `pagoda serve` on --port)")
    p.add_argument("--port", type=int, default=8123)
    p.add_argument("--serve-args", default="--kv-cache-memory 2", help="extra `pagoda serve` flags when launching")
    p.add_argument("--api-key", default=None)
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "console_cost.json")
    return p.parse_args()


def launch(args: argparse.Namespace) -> subprocess.Popen:
    command = [sys.executable, "-m", "pagoda.entrypoints.cli", "serve", "--port", str(args.port)]
    command += shlex.split(args.serve_args)
    if args.api_key:
        command += ["--api-key", args.api_key]
    log = open(Path(tempfile.gettempdir()) / "console_cost_server.log", "w")  # noqa: SIM115 - the server's lifetime
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def wait_ready(base_url: str, api_key: str | None, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base_url}/console/api/info", headers=_headers(api_key), timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{base_url} did not answer within {timeout_s:.0f} s")


def run_once(args: argparse.Namespace, base_url: str, polled: bool) -> dict:
    """One `pagoda bench` level; with `polled`, a 1 Hz feed client runs throughout."""
    stop = threading.Event()
    polls: list[float] = []
    poller = threading.Thread(target=poll_feed, args=(base_url, args.api_key, stop, polls), daemon=True)
    with tempfile.TemporaryDirectory() as out:
        command = [
            sys.executable,
            *("-m", "pagoda.entrypoints.cli", "bench", "--base-url", base_url),
            *("--concurrency", str(args.concurrency), "--num-prompts", str(args.num_prompts)),
            *("--input-len", str(args.input_len), "--output-len", str(args.output_len), "--ignore-eos"),
            *("--warmup", "2", "--reset-prefix-cache", "--output", out, "--no-progress"),
        ]
        if args.api_key:
            command += ["--api-key", args.api_key]
        if polled:
            poller.start()
        try:
            subprocess.run(command, check=True, capture_output=True, text=True)
        finally:
            stop.set()
            if polled:
                poller.join()
        summary = json.loads((Path(out) / "results.json").read_text())["engines"][0]["levels"][0]["summary"]
    return {
        "output_tok_s": summary["output_throughput"],
        "failed": summary["failed"],
        "polls": len(polls),
        "poll_ms_median": statistics.median(polls) * 1000 if polls else None,
    }


def poll_feed(base_url: str, api_key: str | None, stop: threading.Event, polls: list[float]) -> None:
    """What an open dashboard does: the feed once a second, asking only for what is new."""
    after = after_request = 0
    with httpx.Client(base_url=base_url, headers=_headers(api_key), timeout=10) as client:
        while not stop.wait(POLL_S):
            started = time.perf_counter()
            data = client.get("/console/api/feed", params={"after": after, "after_request": after_request}).json()
            polls.append(time.perf_counter() - started)
            if data["samples"]:
                after = data["samples"][-1]["seq"]
            if data["requests"]:
                after_request = data["requests"][-1]["seq"]


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def report(args: argparse.Namespace, runs: list[dict]) -> int:
    ratios = []
    for pair in range(args.pairs):
        none, polled = (next(r for r in runs if r["pair"] == pair and r["polled"] is p) for p in (False, True))
        ratios.append(polled["output_tok_s"] / none["output_tok_s"])
    result = {
        "settings": {k: v for k, v in vars(args).items() if k not in ("api_key", "output")},
        "runs": runs,
        "ratios_polled_over_none": ratios,
        "mean_ratio": statistics.mean(ratios),
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=1) + "\n")
    print("ratios (polled / none):", ", ".join(f"{r:.3f}" for r in ratios))
    print(f"mean {statistics.mean(ratios):.3f} (target above 0.98); wrote {args.output}")
    return 0 if all(r["failed"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
