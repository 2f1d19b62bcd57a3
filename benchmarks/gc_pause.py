"""What a full cyclic-GC collection costs a serving process, with the startup heap frozen and not.

    python benchmarks/gc_pause.py [--model DIR] [--repeats 5]

Loads the server (engine, model, app) in this process as `pagoda serve` does (which freezes the
heap it built: gc.freeze), then times gc.collect() with that heap unfrozen and frozen again. A
full collection holds the GIL, so for its length the engine thread and every stream stop.
Prints one JSON line; docs/server.md quotes a run.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time


def collect_ms(repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        gc.collect()
        times.append(round(1000 * (time.perf_counter() - start), 2))
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="/root/.cache/pagoda-peers/models/smollm2-135m-instruct")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    from pagoda.entrypoints.openai import serve

    serve.load_app(serve.parse_args([args.model, "--max-model-len", "2048", "--kv-cache-memory", "1"]))
    frozen = gc.get_freeze_count()
    gc.unfreeze()
    tracked = len(gc.get_objects())
    unfrozen_ms = collect_ms(args.repeats)
    gc.freeze()
    result = {
        "frozen_at_startup": frozen,
        "tracked_unfrozen": tracked,
        "full_collection_ms_unfrozen": unfrozen_ms,
        "full_collection_ms_frozen": collect_ms(args.repeats),
    }
    print(json.dumps(result))
    os._exit(0)  # the engine thread is a daemon; nothing to shut down gracefully


if __name__ == "__main__":
    main()
