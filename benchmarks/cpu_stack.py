"""The C decoder stack (model_executor/cpu_stack.py) against the module loop it replaces, offline, in
one engine: the batch-1 decode step (ms a token over 128 tokens after a cached 255-token prefix)
and the throughput of 32 fresh 256-token prompts with 64 output tokens each (32 slots), the stack
switched on and off between alternating runs (the same weights, caches and threads). Prints one
JSON line per model.

    python benchmarks/cpu_stack.py [--rounds 3] [--quantization gguf] [--dtype bfloat16] [MODEL]

MODEL: default the shipped Q4_1 GGUF file (with --quantization gguf), or an HF directory.
--dtype bfloat16: the bf16 stack (linears on AMX tiles; needs a CPU with AMX).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pagoda import LLM, SamplingParams  # noqa: E402
from pagoda.model_files import default_model_path  # noqa: E402


def decode_step_ms(llm: LLM, rng: random.Random, tokens: int = 128) -> float:
    """ms a decode step at batch 1: (a request of `tokens` + 1 outputs) - (one of 1), both after the
    same cached 255-token prefix, over `tokens`."""
    prompt = [rng.randrange(100, 40000) for _ in range(256)]
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    llm.generate([prompt], one, use_tqdm=False)  # caches the prefix
    start = time.perf_counter()
    llm.generate([prompt[:255] + [prompt[255] + 1]], one, use_tqdm=False)
    short = time.perf_counter() - start
    start = time.perf_counter()
    many = SamplingParams(temperature=0.0, max_tokens=tokens + 1, ignore_eos=True)
    llm.generate([prompt[:255] + [prompt[255] + 2]], many, use_tqdm=False)
    return (time.perf_counter() - start - short) * 1000 / tokens


def throughput(llm: LLM, rng: random.Random, requests: int = 32) -> float:
    """Output tok/s of `requests` fresh 256-token prompts (no cached prefix), 64 tokens each."""
    prompts = [[rng.randrange(100, 40000) for _ in range(256)] for _ in range(requests)]
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return requests * 64 / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default=None)
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    model = args.model or default_model_path()
    llm = LLM(model, max_model_len=2048, max_num_seqs=32, quantization=args.quantization, dtype=args.dtype)
    runner_model = llm.engine.core.runner.model
    stack = runner_model.cpu_stack
    if stack is None:
        sys.exit("this model is not covered by the C decoder stack")
    rng = random.Random(0)
    decode_step_ms(llm, rng, 8)  # warm up
    steps: dict[str, list[float]] = {"stack": [], "modules": []}
    rates: dict[str, list[float]] = {"stack": [], "modules": []}
    for _ in range(args.rounds):
        for mode in ("stack", "modules"):
            runner_model.cpu_stack = stack if mode == "stack" else None
            steps[mode].append(round(decode_step_ms(llm, rng), 2))
            rates[mode].append(round(throughput(llm, rng), 1))
    runner_model.cpu_stack = stack
    ratio = {
        name: statistics.median(v["stack"]) / statistics.median(v["modules"])
        for name, v in (("step", steps), ("rate", rates))
    }
    result = {
        "model": Path(model).name,
        "quantization": args.quantization,
        "dtype": args.dtype,
        "decode_step_ms_batch1": steps,
        "out_tok_s_32x256_64": rates,
        "median step stack / modules": round(ratio["step"], 2),
        "median tok/s stack / modules": round(ratio["rate"], 2),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
