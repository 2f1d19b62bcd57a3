"""What the server path costs: the same model and workload offline (`LLM.generate`) and through
`pagoda serve` driven by vLLM's client, alternated in rounds on one machine.

    python benchmarks/server_vs_offline.py [--model DIR] [--rounds 3] [--c32-prompts 128]
                                           [--c1-prompts 16] [--port 18440] [--serve-args "..."]

Workload: random 256 in / 64 out, greedy, eos ignored. Offline (a fresh process each round): 32
prompts in one `generate` (output tok/s, prefill included, as the client counts it) and the batch-1
decode step ((time of 65 tokens - time of 1) / 64). Server (a fresh `pagoda serve` each round):
`vllm bench serve` (../shared/peers/vllm-cpu.sh bench) at concurrency 32 and 1: output tok/s and
TPOT p50. The issue's targets: the server's c1 TPOT within 10% of the offline step; c32 tok/s
near offline. Prints each round and the median ratios server / offline as JSON lines; the client's
own CPU shares the machine with the server, as it does in every serving benchmark here.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pagoda.bench.launcher import LaunchSpec, launched, wait_until_ready

ROOT = Path(__file__).resolve().parent.parent
PEERS = ROOT.parent / "shared" / "peers"

OFFLINE = r"""
import json, os, random, sys, time
from pagoda import LLM, SamplingParams
llm = LLM(sys.argv[1], max_model_len=2048)
rng = random.Random(int(sys.argv[2]))
prompt = lambda: [rng.randrange(100, 40000) for _ in range(256)]
def timed(prompts, n):
    p = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    start = time.perf_counter(); llm.generate(prompts, [p] * len(prompts), use_tqdm=False)
    return time.perf_counter() - start
timed([prompt()], 8)  # warm-up
c32 = timed([prompt() for _ in range(32)], 64)
steps = sorted((timed([prompt()], 65) - timed([prompt()], 1)) / 64 for _ in range(3))
print(json.dumps({"c32_tok_s": 32 * 64 / c32, "c1_step_ms": 1000 * steps[1]}))
"""


def offline(model: str, seed: int) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", OFFLINE, model, str(seed)], env=env, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"offline run failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def server(args: argparse.Namespace, seed: int) -> dict:
    command = [sys.executable, "-m", "pagoda.entrypoints.cli", "serve", args.model, "--port", str(args.port)]
    command += ["--served-model-name", "m", "--max-model-len", "2048", "--kv-cache-memory", "4"]
    command += args.serve_args.split()
    env = {"HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    with tempfile.TemporaryDirectory() as tmp:
        spec = LaunchSpec(tuple(command), Path(tmp) / "server.log", env)
        with launched(spec) as proc:
            wait_until_ready(proc, spec, f"http://127.0.0.1:{args.port}", time.perf_counter())
            c32 = client(args, 32, args.c32_prompts, seed, tmp)
            c1 = client(args, 1, args.c1_prompts, seed, tmp)
    return {"c32_tok_s": c32["output_throughput"], "c1_tpot_ms": c1["median_tpot_ms"]}


def client(args: argparse.Namespace, concurrency: int, num_prompts: int, seed: int, tmp: str) -> dict:
    name = f"c{concurrency}.json"
    command = [str(PEERS / "vllm-cpu.sh"), "bench", "--backend", "openai"]
    command += ["--base-url", f"http://127.0.0.1:{args.port}", "--model", "m", "--tokenizer", args.model]
    command += ["--dataset-name", "random", "--random-input-len", "256", "--random-output-len", "64", "--ignore-eos"]
    command += ["--max-concurrency", str(concurrency), "--num-prompts", str(num_prompts), "--seed", str(seed)]
    command += ["--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50", "--disable-tqdm"]
    command += ["--save-result", "--result-dir", tmp, "--result-filename", name]
    out = subprocess.run(command, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"vllm bench serve failed:\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
    return json.loads((Path(tmp) / name).read_text())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="/root/.cache/pagoda-peers/models/smollm2-135m-instruct")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--c32-prompts", type=int, default=128)
    p.add_argument("--c1-prompts", type=int, default=16)
    p.add_argument("--port", type=int, default=18440)
    p.add_argument("--serve-args", default="", help="more flags for pagoda serve")
    args = p.parse_args()
    rounds = []
    for r in range(args.rounds):
        first, second = (offline, server) if r % 2 == 0 else (server, offline)  # alternate which goes first
        results = {f.__name__: f(args.model, r) if f is offline else f(args, r) for f in (first, second)}
        rounds.append(results)
        print(json.dumps({"round": r, **results}), flush=True)
    ratio = {
        "c32_tok_s_server_over_offline": statistics.median(
            x["server"]["c32_tok_s"] / x["offline"]["c32_tok_s"] for x in rounds
        ),
        "c1_tpot_server_over_offline_step": statistics.median(
            x["server"]["c1_tpot_ms"] / x["offline"]["c1_step_ms"] for x in rounds
        ),
    }
    print(json.dumps({"median_ratios": {k: round(v, 3) for k, v in ratio.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
