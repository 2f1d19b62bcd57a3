"""`pagoda generate`: offline completions from the command line, with a progress bar for many prompts."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from pagoda.engine.args import EngineArgs
from pagoda.entrypoints.parsing import Parser
from pagoda.errors import ConfigError


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="pagoda generate", description="Generate completions offline.", config_file=True)
    p.add_argument("prompts", nargs="*", help="prompt texts (or use --prompts-file)")
    p.add_argument("--prompts-file", default=None, help="a file with one prompt per line (default: none)")
    p.add_argument(
        "--chat",
        action="store_true",
        help="wrap each prompt as a user message in the chat template (default: %(default)s)",
    )
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per prompt (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=0, help="0: no top-k (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt (default: %(default)s)")
    p.add_argument(
        "--lora-path",
        default=None,
        help="a LoRA adapter folder (PEFT's) every prompt runs with; needs --enable-lora (default: none)",
    )
    EngineArgs.add_cli_args(p, positional_model=False)
    return p


def read_prompts(path: str) -> list[str]:
    """One prompt per non-blank line."""
    with open(path, encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f if line.strip()]


def _reason(exc: OSError | UnicodeDecodeError) -> str:
    return exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    prompts = list(args.prompts)
    if args.prompts_file:
        try:
            prompts += read_prompts(args.prompts_file)
        except (OSError, UnicodeDecodeError) as exc:
            print(f"pagoda generate: cannot read --prompts-file {args.prompts_file}: {_reason(exc)}", file=sys.stderr)
            return 1
    if not prompts:
        print("pagoda generate: give at least one prompt", file=sys.stderr)
        return 2
    from pagoda import LLM, LoRARequest, SamplingParams

    if args.lora_path is not None and not args.enable_lora:
        print("pagoda generate: --lora-path needs --enable-lora", file=sys.stderr)
        return 2
    try:  # the sampling flags are checked first: a bad one is told before the model loads
        params = SamplingParams(
            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, max_tokens=args.max_tokens
        )
        lora = None if args.lora_path is None else LoRARequest("adapter", 1, args.lora_path)
        llm = LLM(**dataclasses.asdict(EngineArgs.from_cli_args(args)))
    except (ConfigError, ValueError) as exc:
        print(f"pagoda generate: {exc}", file=sys.stderr)
        return 1
    many = len(prompts) > 1
    try:
        if args.chat:
            conversations = [[{"role": "user", "content": p}] for p in prompts]
            results = llm.chat(conversations, params, use_tqdm=many, lora_request=lora)
        else:
            results = llm.generate(prompts, params, use_tqdm=many, lora_request=lora)
    except (ConfigError, ValueError) as exc:  # a prompt the engine refuses: empty, or past the context
        print(f"pagoda generate: {exc}", file=sys.stderr)
        return 1
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
