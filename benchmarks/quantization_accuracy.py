"""Accuracy of the quantized CPU formats against the float32 model on the same weights.

The reference is the default model's Q4_1 file dequantized to float32 (Pagoda's default load,
token-exact against transformers). Each format scores every position of a fixed text: the
log-probability it gives the text's next token, against the reference's (mean and max |delta|),
whether its top-1 token is the reference's, and its perplexity on the text.
  gguf-Q4_1  the shipped file with --quantization gguf: the same weights, dequantized in the kernels
  gguf-Q8_0, gguf-Q4_0  its weights re-quantized (tests/gguf_files.py), with --quantization gguf
  int8       the float32 HF directory with --quantization int8
  (each of these with its default cache, bf16)
  gguf-Q4_1-kv-f32, int8-kv-f32  the same with --kv-cache-dtype float32
  kv-bf16    the float32 model with --kv-cache-dtype bfloat16 (keys and values stored rounded to bf16)
An accuracy measurement, not a timing: it may run on a busy machine.

    python benchmarks/quantization_accuracy.py [--tokens 2048] [--out benchmarks/results/quantization]
        [--only kv-bf16,...]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pagoda import LLM, SamplingParams  # noqa: E402
from pagoda.model_files import cache_root, default_model_path, resolve_model  # noqa: E402
from tests.gguf_files import requantize_gguf  # noqa: E402

TEXT = Path("/usr/share/common-licenses/GPL-3")  # a fixed English text, shipped with Debian


def next_token_scores(llm: LLM, ids: list[int]) -> tuple[list[float], list[int]]:
    """For positions 1..n-1 of `ids`: the model's logprob of ids[i] and its top-1 token there."""
    out = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0), use_tqdm=False)[0]
    true_lp, top1 = [], []
    for token, position in zip(ids[1:], out.prompt_logprobs[1:]):
        true_lp.append(position[token].logprob)
        top1.append(next(t for t, lp in position.items() if lp.rank == 1))
    return true_lp, top1


def compare(reference: tuple[list[float], list[int]], ours: tuple[list[float], list[int]]) -> dict:
    (ref_lp, ref_top), (lp, top) = reference, ours
    deltas = [abs(a - b) for a, b in zip(ref_lp, lp)]
    return {
        "mean_abs_delta_logprob": sum(deltas) / len(deltas),
        "max_abs_delta_logprob": max(deltas),
        "top1_agreement": sum(a == b for a, b in zip(ref_top, top)) / len(top),
        "perplexity": math.exp(-sum(lp) / len(lp)),
    }


def variants(cache: Path) -> dict[str, tuple[str, str | None, str]]:
    """name -> (model, quantization, kv_cache_dtype)"""
    q4_1 = default_model_path()
    return {
        "fp32": (resolve_model(q4_1), None, "auto"),
        "gguf-Q4_1": (q4_1, "gguf", "auto"),
        "gguf-Q8_0": (str(requantize_gguf(q4_1, cache / "SmolLM2-135M-Instruct.Q8_0.gguf", "Q8_0")), "gguf", "auto"),
        "gguf-Q4_0": (str(requantize_gguf(q4_1, cache / "SmolLM2-135M-Instruct.Q4_0.gguf", "Q4_0")), "gguf", "auto"),
        "int8": (resolve_model(q4_1), "int8", "auto"),
        "gguf-Q4_1-kv-f32": (q4_1, "gguf", "float32"),
        "int8-kv-f32": (resolve_model(q4_1), "int8", "float32"),
        "kv-bf16": (resolve_model(q4_1), None, "bfloat16"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/quantization"))
    parser.add_argument("--only", default="", help="comma-separated variants to score besides fp32 (default: all)")
    args = parser.parse_args()
    scored: dict[str, tuple] = {}
    ids: list[int] = []
    for name, (model, quantization, kv_dtype) in variants(cache_root() / "requantized").items():
        if args.only and name not in ("fp32", *args.only.split(",")):
            continue
        llm = LLM(
            model,
            quantization=quantization,
            kv_cache_dtype=kv_dtype,
            max_model_len=args.tokens + 8,
            kv_cache_memory=0.5,
        )
        ids = ids or llm.tokenizer.encode(TEXT.read_text())[: args.tokens]
        scored[name] = next_token_scores(llm, ids)
        del llm
    results = {name: compare(scored["fp32"], s) for name, s in scored.items() if name != "fp32"}
    report = {"text": str(TEXT), "tokens": len(ids), "reference": "fp32 (the Q4_1 file dequantized)"}
    report["reference_perplexity"] = math.exp(-sum(scored["fp32"][0]) / len(scored["fp32"][0]))
    report["formats"] = results
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "accuracy.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [
        f"Scored on {len(ids)} tokens of {TEXT}; reference fp32 perplexity {report['reference_perplexity']:.3f}.",
        "",
        "| format | mean abs delta logprob | max abs delta | top-1 agreement | perplexity |",
        "|---|---|---|---|---|",
    ]
    for name, r in results.items():
        lines.append(
            f"| {name} | {r['mean_abs_delta_logprob']:.2e} | {r['max_abs_delta_logprob']:.2e} | "
            f"{r['top1_agreement']:.4f} | {r['perplexity']:.3f} |"
        )
    (out / "accuracy.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
