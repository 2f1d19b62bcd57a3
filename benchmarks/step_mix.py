"""Where a closed loop's time goes, step by step, offline: CONCURRENCY requests in flight (random
256 in / 64 out, greedy, eos ignored), each finished one replaced at once, as vLLM's client keeps
a server busy at that concurrency. Every step is timed and sorted by kind from the scheduler's
counters: mixed (prompt tokens beside decodes), decode-only, prompt-only. The first fifth of the
steps (the loop filling up) is left out.

    PYTHONPATH=. python benchmarks/step_mix.py [--model DIR] [--concurrency 32] [--requests 200]
        [--engine-args '{"max_prefill_with_decodes": 128}']

Prints one JSON line: per kind its steps, share of the time, median step ms, mean decode rows and
prompt tokens; and the window's output tok/s (decode tokens over the steps' time).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pagoda import LLM, SamplingParams  # noqa: E402

MODEL = "/root/.cache/pagoda-peers/models/smollm2-135m-instruct"


def kind(decodes: int, prompt_tokens: int) -> str:
    if not prompt_tokens:
        return "decode-only"
    return "mixed" if decodes else "prompt-only"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--engine-args", default="{}", help="more LLM arguments, as JSON")
    args = parser.parse_args()
    llm = LLM(
        args.model, dtype="float32", max_model_len=2048, enable_prefix_caching=False, **json.loads(args.engine_args)
    )
    engine, rng = llm.engine, random.Random(0)
    vocab = engine.config.model.vocab_size
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)

    def send() -> None:
        engine.add_request([rng.randrange(100, vocab) for _ in range(256)], params)

    for _ in range(args.concurrency):
        send()
    sent, steps = args.concurrency, []  # steps: (decode rows, prompt tokens, seconds)
    before = engine.core.stats()
    while engine.has_unfinished:
        start = time.perf_counter()
        updates = engine.step()
        seconds = time.perf_counter() - start
        after = engine.core.stats()
        # a prompt's last chunk samples its first token too: a decode's token is a later one
        decodes = sum(1 for u in updates if u.token_ids_delta and len(u.token_ids) > 1)
        steps.append((decodes, after.prompt_tokens - before.prompt_tokens, seconds))
        before = after
        for update in updates:
            if update.finish_reason is not None and sent < args.requests:
                send()
                sent += 1
    window = steps[len(steps) // 5 :]
    total = sum(s for *_, s in window)
    kinds = {}
    for name in ("mixed", "decode-only", "prompt-only"):
        chosen = [(d, p, s) for d, p, s in window if kind(d, p) == name]
        if chosen:
            kinds[name] = {
                "steps": len(chosen),
                "time_share": round(sum(s for *_, s in chosen) / total, 3),
                "median_ms": round(1e3 * statistics.median(s for *_, s in chosen), 1),
                "decode_rows": round(statistics.mean(d for d, *_ in chosen), 1),
                "prompt_tokens": round(statistics.mean(p for _, p, _ in chosen), 1),
            }
    output = sum(d for d, *_ in window)
    print(
        json.dumps(
            {
                "concurrency": args.concurrency,
                "engine_args": json.loads(args.engine_args),
                "kinds": kinds,
                "output_tok_s": round(output / total, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
