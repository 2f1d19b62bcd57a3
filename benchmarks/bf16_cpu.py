"""bf16 against fp32 on the CPU, the default model, offline: decode step time at batch 1 and 32
(prompts of a shared 256-token prefix, so reps after the first skip most prefill) and prefill
tokens/s of a fresh 1,000-token prompt. Also bf16 on torch's path (no packed linears, no GEMV,
the torch attention backend), as it served before. Configurations alternate within each
repetition, in turn forwards and backwards; the figures are medians over repetitions.

    python benchmarks/bf16_cpu.py [--reps 5] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pagoda import LLM, SamplingParams  # noqa: E402

DECODE_STEPS = 16


def load(name: str, threads: int | None) -> LLM:
    """'bf16-torch': bf16 with the kernels capped below AVX512-BF16 while loading (torch's linears)."""
    dtype = "float32" if name == "fp32" else "bfloat16"
    backend = "torch" if name == "bf16-torch" else "auto"
    if name == "bf16-torch":
        os.environ["PAGODA_CPU_ISA"] = "avx512"
    try:
        return LLM(
            dtype=dtype, attention_backend=backend, kv_cache_memory=0.5, max_num_batched_tokens=8192, threads=threads
        )
    finally:
        os.environ.pop("PAGODA_CPU_ISA", None)


def decode_step_ms(llm: LLM, batch: int, prefix: list[int], rng: random.Random) -> float:
    """Median time of DECODE_STEPS steps once every request of the batch is decoding."""
    params = SamplingParams(temperature=0.0, max_tokens=DECODE_STEPS + 2, ignore_eos=True)
    for _ in range(batch):
        llm.engine.add_request(prefix + [rng.randrange(100, 40000)], params)
    llm.engine.step()  # the prefills and first tokens
    times = []
    while llm.engine.has_unfinished:
        start = time.perf_counter()
        llm.engine.step()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times[:DECODE_STEPS])


def prefill_tokens_per_s(llm: LLM, rng: random.Random, length: int = 1000) -> float:
    prompt = [rng.randrange(100, 40000) for _ in range(length)]
    start = time.perf_counter()
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1))
    return length / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, help="the engines' compute threads; default: auto")
    parser.add_argument("--output", help="default: benchmarks/results/bf16_cpu_{threads}threads.json")
    args = parser.parse_args()
    names = ["fp32", "bf16", "bf16-torch"]
    engines = {name: load(name, args.threads) for name in names}
    rng = random.Random(0)
    prefix = [rng.randrange(100, 40000) for _ in range(256)]
    samples: dict[str, dict[str, list[float]]] = {
        n: {"decode_b1_ms": [], "decode_b32_ms": [], "prefill_tok_s": []} for n in names
    }
    for rep in range(args.reps):
        for name in names if rep % 2 == 0 else names[::-1]:
            llm, s = engines[name], samples[name]
            s["decode_b1_ms"].append(decode_step_ms(llm, 1, prefix, rng))
            s["decode_b32_ms"].append(decode_step_ms(llm, 32, prefix, rng))
            s["prefill_tok_s"].append(prefill_tokens_per_s(llm, rng))
        print(f"rep {rep}: " + "; ".join(f"{n} {[round(v[-1], 1) for v in samples[n].values()]}" for n in names))
    medians = {n: {k: round(statistics.median(v), 2) for k, v in s.items()} for n, s in samples.items()}
    print(json.dumps(medians, indent=1))
    for key, fp32 in samples["fp32"].items():  # per-repetition ratios: robust to load that drifts between reps
        ratios = [a / b if key.endswith("ms") else b / a for a, b in zip(fp32, samples["bf16"][key])]
        print(f"{key}: bf16 {statistics.median(ratios):.2f}x fp32's speed (median of {len(ratios)} reps)")
    output = args.output or f"benchmarks/results/bf16_cpu_{args.threads or 'auto'}threads.json"
    Path(output).write_text(
        json.dumps({"reps": args.reps, "threads": args.threads, "medians": medians, "samples": samples}, indent=1)
        + "\n"
    )


if __name__ == "__main__":
    main()
