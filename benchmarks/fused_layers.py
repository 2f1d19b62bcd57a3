"""What the fused CPU layers (pagoda/model_executor/cpu_layers.py) buy: the decode step time of the
default model (fp32) with them and with torch's layers. One engine, its layers swapped between
steps (ABBA order): both sides read the same weights for the same requests, and a busy machine
slows both alike. BATCH requests with 256-token prompts are prefilled, then STEPS decode steps of
each side are timed.

    PYTHONPATH=. python benchmarks/fused_layers.py [--batch 1 8 32] [--steps 60] [--threads N]

Prints one JSON line per batch size: each side's median step time, wall and CPU (the process's:
with --threads 1, the work done, however long a busy machine keeps it waiting), and the median
ratio of each fused step to the torch step next to it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def load_torch_layers(threads: int | None):
    """An engine whose model kept torch's layers, and the model."""
    from unittest import mock

    from pagoda import LLM
    from pagoda.model_executor import cpu_layers

    with mock.patch.object(cpu_layers, "supported", lambda dtype, device: False):
        llm = LLM(
            dtype="float32", kv_cache_memory=1.0, max_model_len=2048, max_num_batched_tokens=1024, threads=threads
        )
    return llm.engine, llm.engine.core.runner.model


def layer_sides(model) -> dict[str, list[tuple]]:
    """For each side, the (parent, attribute, module) assignments that put its layers in place."""
    from pagoda.kernels import cpu
    from pagoda.model_executor import cpu_layers
    from pagoda.model_executor.layers import ResidualRMSNorm, RotaryEmbedding, SiluAndMul

    lib = cpu.load()
    fused = {
        ResidualRMSNorm: lambda m: cpu_layers.CpuResidualRMSNorm(m, lib),
        SiluAndMul: lambda m: cpu_layers.CpuSiluAndMul(lib),
        RotaryEmbedding: lambda m: cpu_layers.CpuRotaryEmbedding(m, lib),
    }
    sides: dict[str, list[tuple]] = {"torch": [], "fused": []}
    for name, module in list(model.named_modules()):
        if type(module) in fused:
            parent_name, _, attr = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            sides["torch"].append((parent, attr, module))
            sides["fused"].append((parent, attr, fused[type(module)](module)))
    return sides


def timed_step(engine, side: list[tuple]) -> tuple[float, float]:
    """Wall and CPU milliseconds of one step with `side`'s layers."""
    for parent, attr, module in side:
        setattr(parent, attr, module)
    wall, cpu = time.perf_counter(), time.process_time()
    engine.step()
    return (time.perf_counter() - wall) * 1e3, (time.process_time() - cpu) * 1e3


def compare(engine, sides: dict, batch: int, steps: int, prompt_len: int) -> dict:
    from pagoda import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=2 * steps + 8, ignore_eos=True)
    rng = random.Random(batch)
    ids = {engine.add_request([rng.randrange(100, 40000) for _ in range(prompt_len)], params) for _ in range(batch)}
    started: set[str] = set()
    while started != ids:  # until every prompt is prefilled
        started.update(update.request_id for update in engine.step())
    for _ in range(3):
        engine.step()
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in sides}
    for i in range(steps):
        for name in list(sides) if i % 2 == 0 else list(reversed(sides)):
            times[name].append(timed_step(engine, sides[name]))
    while engine.has_unfinished:
        engine.step()
    result: dict = {"batch": batch}
    for i, kind in enumerate(("wall", "cpu")):
        for name, t in times.items():
            result[f"{name}_{kind}_ms"] = round(statistics.median(s[i] for s in t), 2)
        # each step against its neighbour on the other side: robust to the machine's load drifting
        ratios = (f[i] / t[i] for f, t in zip(times["fused"], times["torch"]))
        result[f"{kind}_paired_ratio"] = round(statistics.median(ratios), 3)
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--threads", type=int, help="compute threads (default: the engine's auto pool)")
    args = ap.parse_args()
    engine, model = load_torch_layers(args.threads)
    sides = layer_sides(model)
    for batch in args.batch:
        print(json.dumps(compare(engine, sides, batch, args.steps, args.prompt_len)), flush=True)


if __name__ == "__main__":
    main()
