"""Offline speed of each weight format on the default model (no server): prefill tokens per second
(one prompt of --prompt tokens, one output token) and batch-1 decode (one prompt of 16 tokens,
--decode tokens out, ignore_eos): ms per output token and tokens per second. Runs each format in a
fresh process so that one's memory and threads do not touch the next's. A timing: run it on a
quiet machine.

    python benchmarks/quantization_speed.py [--json OUT.json] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FORMATS = ["fp32", "gguf-Q4_1", "gguf-Q8_0", "gguf-Q4_0", "int8"]


def measure(fmt: str, prompt_len: int, decode_len: int, repeats: int) -> dict:
    sys.path.insert(0, str(ROOT))
    from pagoda import LLM, SamplingParams
    from pagoda.model_files import cache_root, default_model_path, resolve_model
    from tests.gguf_files import requantize_gguf

    q4_1 = default_model_path()
    if fmt == "fp32" or fmt == "int8":
        model, quantization = resolve_model(q4_1), (None if fmt == "fp32" else "int8")
    elif fmt == "gguf-Q4_1":
        model, quantization = q4_1, "gguf"
    else:
        kind = fmt.removeprefix("gguf-")
        target = cache_root() / "requantized" / f"SmolLM2-135M-Instruct.{kind}.gguf"
        model, quantization = str(requantize_gguf(q4_1, target, kind)), "gguf"
    llm = LLM(model, quantization=quantization, max_model_len=prompt_len + 64, enable_prefix_caching=False)
    prompt = [(i * 7919) % 30000 + 100 for i in range(prompt_len)]
    short = prompt[:16]
    llm.generate([short], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)  # warm up
    prefill, decode = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)
        prefill.append(prompt_len / (time.perf_counter() - start))
        start = time.perf_counter()
        llm.generate([short], SamplingParams(max_tokens=1), use_tqdm=False)
        first = time.perf_counter() - start
        start = time.perf_counter()
        llm.generate([short], SamplingParams(max_tokens=decode_len + 1, ignore_eos=True), use_tqdm=False)
        decode.append((time.perf_counter() - start - first) / decode_len)  # the prefill step taken out
    best = min(decode)
    return {"prefill_tok_s": max(prefill), "decode_ms_per_token": best * 1e3, "decode_tok_s": 1 / best}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--decode", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # the child process: measure this format, print JSON
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args.prompt, args.decode, args.repeats)))
        return
    results = {}
    for fmt in args.formats.split(","):
        command = [sys.executable, __file__, "--one", fmt, "--prompt", str(args.prompt)]
        command += ["--decode", str(args.decode), "--repeats", str(args.repeats)]
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        results[fmt] = json.loads(done.stdout.strip().splitlines()[-1])
        r = results[fmt]
        print(
            f"{fmt:<10} prefill {r['prefill_tok_s']:8.0f} tok/s   decode {r['decode_ms_per_token']:6.2f} ms/token "
            f"({r['decode_tok_s']:.0f} tok/s)",
            flush=True,
        )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
