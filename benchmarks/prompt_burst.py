"""A burst of prefix-cache hits arriving together beside running decodes, offline (the engine's own
steps, no HTTP): how long each hit waits for its first token and how long the decodes wait for
theirs meanwhile. The shape of the shared-prefix bake-off when its requests move in lockstep
(benchmarks/prefix_cache/shared_prefix.toml: 8 requests that ended in one step send their next
ones together): a 1,024-token system prompt cached, `--decodes` requests decoding, then `--hits`
requests of that prompt + 46 new tokens added at once.

    python benchmarks/prompt_burst.py [--model DIR] [--hits 6] [--decodes 2] [--rounds 5]

Prints one JSON line: per round the hits' times to first token (ms, sorted) and the longest gap
between two tokens of a decode while the burst ran; then the medians over rounds. Run it on two
trees (PYTHONPATH=TREE) to compare scheduling policies.
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


def one_round(llm: LLM, prefix: list[int], hits: int, decodes: int, seed: int) -> dict:
    engine, rng = llm.engine, random.Random(seed)
    vocab = engine.config.model.vocab_size
    decoding_params = SamplingParams(max_tokens=200, ignore_eos=True)  # still decoding when the burst ends
    decoding = [
        engine.add_request([rng.randrange(100, vocab) for _ in range(64)], decoding_params) for _ in range(decodes)
    ]
    engine.step()  # the decodes' prompts
    engine.step()  # their first decode
    params = SamplingParams(max_tokens=1)
    added = time.perf_counter()
    waiting = {engine.add_request(prefix + [rng.randrange(100, vocab) for _ in range(46)], params) for _ in range(hits)}
    first: list[float] = []
    last_token = {request_id: added for request_id in decoding}
    gaps = []
    while waiting:
        updates = engine.step()
        now = time.perf_counter()
        for update in updates:
            if update.request_id in waiting and update.finished:
                waiting.discard(update.request_id)
                first.append((now - added) * 1e3)
            elif update.request_id in last_token:
                gaps.append((now - last_token[update.request_id]) * 1e3)
                last_token[update.request_id] = now
    engine.abort(decoding)
    while engine.has_unfinished:
        engine.step()
    return {"ttft_ms": sorted(round(t, 1) for t in first), "decode_gap_max_ms": round(max(gaps, default=0.0), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--hits", type=int, default=6)
    parser.add_argument("--decodes", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    llm = LLM(args.model, dtype="float32", max_model_len=2048)
    vocab = llm.engine.config.model.vocab_size
    prefix = [random.Random(0).randrange(100, vocab) for _ in range(1024)]
    llm.generate([prefix], SamplingParams(max_tokens=1), use_tqdm=False)  # caches the prefix
    one_round(llm, prefix, args.hits, args.decodes, seed=-1)  # warm-up
    rounds = [one_round(llm, prefix, args.hits, args.decodes, seed=r) for r in range(args.rounds)]
    summary = {
        "ttft_p50_ms": statistics.median(statistics.median(r["ttft_ms"]) for r in rounds),
        "ttft_mean_ms": statistics.median(statistics.mean(r["ttft_ms"]) for r in rounds),
        "ttft_last_ms": statistics.median(r["ttft_ms"][-1] for r in rounds),
        "decode_gap_max_ms": statistics.median(r["decode_gap_max_ms"] for r in rounds),
    }
    print(json.dumps({"hits": args.hits, "decodes": args.decodes, "rounds": rounds, "median": summary}))


if __name__ == "__main__":
    main()
