"""Offline throughput: Pagoda against transformers `generate` on the default model, in one run.

Workload (seeded): 32 prompts of random token ids, 64..512 tokens in, 16..128 tokens out, greedy,
eos ignored so both produce exactly the requested lengths. transformers runs them as one padded
batch (left padding; a static batch runs until its longest output, so the figure counted is the
requested output tokens, which is what a user gets). Batch 1: one 256-token prompt, 128 out.

    python benchmarks/offline_throughput.py [--dtype float32] [--num-prompts 32] [--pagoda-only]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch


def workload(num_prompts: int, vocab: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        ([rng.randrange(100, vocab) for _ in range(rng.randint(64, 512))], rng.randint(16, 128))
        for _ in range(num_prompts)
    ]


def run_pagoda(llm, jobs) -> float:
    from pagoda import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in jobs]
    start = time.perf_counter()
    outs = llm.generate([p for p, _ in jobs], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert [len(o.outputs[0].token_ids) for o in outs] == [n for _, n in jobs]
    return elapsed


@torch.inference_mode()
def run_transformers(model, jobs, pad_id: int) -> float:
    longest = max(len(p) for p, _ in jobs)
    ids = torch.full((len(jobs), longest), pad_id)
    mask = torch.zeros((len(jobs), longest), dtype=torch.long)
    for i, (p, _) in enumerate(jobs):
        ids[i, longest - len(p) :] = torch.tensor(p)
        mask[i, longest - len(p) :] = 1
    max_new = max(n for _, n in jobs)
    start = time.perf_counter()
    model.generate(
        ids, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False, pad_token_id=pad_id
    )
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output", help="write the results as JSON here")
    ap.add_argument("--pagoda-only", action="store_true", help="skip transformers (Pagoda against itself)")
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    from pagoda import LLM
    from pagoda.model_files import resolve_model

    llm = LLM(dtype=args.dtype, kv_cache_memory=1.0, max_model_len=2048, max_num_batched_tokens=1024)
    model = None
    if not args.pagoda_only:
        model = AutoModelForCausalLM.from_pretrained(resolve_model(None), dtype=getattr(torch, args.dtype)).eval()
    vocab = llm.engine.config.model.vocab_size
    rows = []
    for label, jobs in (
        (f"{args.num_prompts} prompts", workload(args.num_prompts, vocab, args.seed)),
        ("batch 1", [(workload(1, vocab, args.seed + 1)[0][0][:256], 128)]),
    ):
        run_pagoda(llm, jobs[:2])  # warm-up
        out_tokens = sum(n for _, n in jobs)
        pagoda_s = run_pagoda(llm, jobs)
        hf_s = run_transformers(model, jobs, pad_id=0) if model is not None else float("nan")
        rows.append(
            {
                "workload": label,
                "output_tokens": out_tokens,
                "pagoda_tok_s": out_tokens / pagoda_s,
                "transformers_tok_s": out_tokens / hf_s,
                "ratio": hf_s / pagoda_s,
            }
        )
    print(f"{'workload':<12} {'out tokens':>10} {'pagoda tok/s':>13} {'transformers tok/s':>19} {'ratio':>6}")
    for r in rows:
        print(
            f"{r['workload']:<12} {r['output_tokens']:>10} {r['pagoda_tok_s']:>13.1f} "
            f"{r['transformers_tok_s']:>19.1f} {r['ratio']:>5.2f}x"
        )
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"dtype": args.dtype, "threads": torch.get_num_threads(), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
