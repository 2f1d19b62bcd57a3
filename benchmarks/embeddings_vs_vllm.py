"""Embeddings served side by side: Pagoda (`--runner pooling`) and vLLM's CPU build (`--runner
pooling`), one after the other on this machine, the same HF folder (the default model in float32,
LAST pooling with unit length, each engine's default), the same client and texts.

For each engine: its cold start (launch to /health answering), then POST /v1/embeddings with
- latency: one text of ~64 tokens at a time, ROUNDS_LATENCY requests, p50 and p90 ms;
- throughput: TEXTS texts of ~128 tokens (all distinct: no prefix-cache hits), BATCH inputs a
  request, CONCURRENCY requests in flight: prompt tokens embedded per second of wall time;
and the vectors of the first texts, to compare the two engines' (the largest absolute difference
and the smallest cosine between them: both are the same model's last hidden states in float32).

    python benchmarks/embeddings_vs_vllm.py [--out DIR] [--texts 256] [--batch 16] [--concurrency 4]

Writes DIR/results.json and prints a table with each figure's ratio (Pagoda / vLLM).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
PEERS = ROOT.parent / "shared" / "peers"
PORT = 18400
WORDS = (
    "river mountain quiet engine paper window garden signal market winter orange theory silver "
    "harbor pencil school thunder bridge coffee planet shadow ladder circle forest number station "
    "letter castle mirror button rocket island candle meadow whisper velvet lantern compass"
).split()


def texts(count: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [f"{i}: " + " ".join(rng.choice(WORDS) for _ in range(words)) for i in range(count)]


def command(engine: str, model_dir: str) -> list[str]:
    if engine == "pagoda":
        return [
            "python", "-m", "pagoda.entrypoints.cli", "serve", model_dir, "--port", str(PORT), "--runner", "pooling",
            "--dtype", "float32", "--served-model-name", "smollm2", "--max-model-len", "2048",
            "--kv-cache-memory", "4",
        ]  # fmt: skip
    return [
        str(PEERS / "vllm-cpu.sh"), "serve", str(PORT), "--runner", "pooling", "--served-model-name", "smollm2",
        "--max-model-len", "2048",
    ]  # fmt: skip


def start(engine: str, model_dir: str, log: Path) -> tuple[subprocess.Popen, float]:
    began = time.monotonic()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MODEL": model_dir}
    with log.open("w") as out:
        process = subprocess.Popen(
            command(engine, model_dir), stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    while True:
        if process.poll() is not None:
            raise SystemExit(f"{engine} exited:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{PORT}/health", timeout=2).status_code == 200:
                return process, time.monotonic() - began
        except httpx.TransportError:
            pass
        time.sleep(0.5)


def stop(process: subprocess.Popen) -> None:
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


async def measure(args: argparse.Namespace) -> dict:
    url = f"http://127.0.0.1:{PORT}/v1/embeddings"
    async with httpx.AsyncClient(timeout=600) as client:

        async def embed(inputs: list[str]) -> dict:
            response = await client.post(url, json={"model": "smollm2", "input": inputs})
            response.raise_for_status()
            return response.json()

        await embed(texts(8, 64, seed=1))  # warm-up
        latencies = []
        for text in texts(args.latency_requests, 50, seed=2):
            began = time.perf_counter()
            await embed([text])
            latencies.append((time.perf_counter() - began) * 1000)
        work = texts(args.texts, 100, seed=3)
        batches = [work[i : i + args.batch] for i in range(0, len(work), args.batch)]
        queue: asyncio.Queue = asyncio.Queue()
        for batch in batches:
            queue.put_nowait(batch)
        tokens = 0

        async def worker() -> None:
            nonlocal tokens
            while not queue.empty():
                answer = await embed(queue.get_nowait())  # awaited before `tokens` is read: no update lost
                tokens += answer["usage"]["prompt_tokens"]

        began = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        wall = time.perf_counter() - began
        vectors = [d["embedding"] for d in (await embed(work[:8]))["data"]]
    return {
        "latency_p50_ms": statistics.median(latencies),
        "latency_p90_ms": statistics.quantiles(latencies, n=10)[-1],
        "throughput_tokens_per_s": tokens / wall,
        "throughput_texts_per_s": len(work) / wall,
        "prompt_tokens": tokens,
        "vectors": vectors,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "embeddings_vs_vllm")
    parser.add_argument("--texts", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--latency-requests", type=int, default=20)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir = subprocess.run([str(PEERS / "smollm2-hf.sh")], capture_output=True, text=True, check=True).stdout
    model_dir = model_dir.strip().splitlines()[-1]
    results = {}
    for engine in ("pagoda", "vllm"):
        process, cold = start(engine, model_dir, args.out / f"{engine}.log")
        try:
            results[engine] = {"cold_start_s": cold, **asyncio.run(measure(args))}
        finally:
            stop(process)
    ours, theirs = results["pagoda"], results["vllm"]
    pairs = list(zip(ours.pop("vectors"), theirs.pop("vectors")))
    results["vectors_max_abs_diff"] = max(abs(a - b) for x, y in pairs for a, b in zip(x, y))
    results["vectors_min_cosine"] = min(
        sum(a * b for a, b in zip(x, y)) / (sum(a * a for a in x) * sum(b * b for b in y)) ** 0.5 for x, y in pairs
    )
    results["settings"] = vars(args) | {"out": str(args.out), "model": model_dir}
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    print(f"{'':28}{'pagoda':>12}{'vllm':>12}{'ratio':>9}")
    for key in (
        "cold_start_s",
        "latency_p50_ms",
        "latency_p90_ms",
        "throughput_tokens_per_s",
        "throughput_texts_per_s",
    ):
        print(f"{key:28}{ours[key]:12.1f}{theirs[key]:12.1f}{ours[key] / theirs[key]:8.2f}x")
    print(f"vectors: max |diff| {results['vectors_max_abs_diff']:.2e}, min cosine {results['vectors_min_cosine']:.7f}")


if __name__ == "__main__":
    main()
