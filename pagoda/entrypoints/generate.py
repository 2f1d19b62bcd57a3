"""`pagoda generate`: offline completions from the command line, with a progress bar for many prompts."""

from __future__ import annotations

import argparse
import json
import sys

from pagoda.errors import ConfigError


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pagoda generate", description="Generate completions offline.")
    p.add_argument("prompts", nargs="*", help="prompt texts (or use --prompts-file)")
    p.add_argument(
        "--model", default=None, help="HF directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)"
    )
    p.add_argument("--prompts-file", help="a file with one prompt per line")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--kv-cache-memory", type=float, default=2.0, help="KV cache size in GiB")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    prompts = list(args.prompts)
    if args.prompts_file:
        with open(args.prompts_file, encoding="utf-8") as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    if not prompts:
        print("pagoda generate: give at least one prompt", file=sys.stderr)
        return 2
    from pagoda import LLM, SamplingParams

    try:
        llm = LLM(args.model, dtype=args.dtype, max_model_len=args.max_model_len, kv_cache_memory=args.kv_cache_memory)
        params = SamplingParams(
            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed, max_tokens=args.max_tokens
        )
    except (ConfigError, ValueError) as exc:
        print(f"pagoda generate: {exc}", file=sys.stderr)
        return 1
    many = len(prompts) > 1
    if args.chat:
        results = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=many)
    else:
        results = llm.generate(prompts, params, use_tqdm=many)
    for prompt, result in zip(prompts, results):
        out = result.outputs[0]
        if args.json:
            print(
                json.dumps(
                    {
                        "prompt": prompt,
                        "text": out.text,
                        "finish_reason": out.finish_reason,
                        "output_tokens": len(out.token_ids),
                    }
                )
            )
        else:
            print(out.text if not many else f"### {prompt}\n{out.text}\n")
    return 0
