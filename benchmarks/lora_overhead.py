"""What LoRA costs on the CPU: the default model offline, without --enable-lora, with it for base
requests, and with it for requests of a rank-16 adapter on all seven projections of every layer
(random weights in PEFT's format, written here), in alternating fresh processes.

    python benchmarks/lora_overhead.py [--rounds 3] [--rank 16]

Workload: random 256 in / 64 out, greedy, eos ignored: 32 prompts in one `generate` (output tok/s,
prefill included) and the batch-1 decode step ((time of 65 tokens - time of 1) / 64). Prints each
run and the medians as JSON lines, with ratios to the run without LoRA.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

RUN = r"""
import json, random, sys, time
from pagoda import LLM, LoRARequest, SamplingParams
mode, adapter = sys.argv[1], sys.argv[2]
llm = LLM(max_model_len=2048, enable_lora=mode != "off")
lora = LoRARequest("bench", 1, adapter) if mode == "adapter" else None
rng = random.Random(0)
prompt = lambda: [rng.randrange(100, 40000) for _ in range(256)]
def timed(prompts, n):
    p = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, p, use_tqdm=False, lora_request=lora)
    return time.perf_counter() - start
timed([prompt()], 4)  # warm: kernels built, pages touched
one = [prompt()]
step = (timed(one, 65) - timed(one, 1)) / 64
batch = [prompt() for _ in range(32)]
print(json.dumps({"mode": mode, "c1_step_ms": step * 1000, "c32_tok_s": 32 * 64 / timed(batch, 64)}))
"""

# the default model's shapes (SmolLM2-135M): hidden 576, 9 query and 3 kv heads of 64, MLP 1536, 30 layers
SHAPES = {"q_proj": (576, 576), "k_proj": (576, 192), "v_proj": (576, 192), "o_proj": (576, 576)}
SHAPES |= {"gate_proj": (576, 1536), "up_proj": (576, 1536), "down_proj": (1536, 576)}


def write_adapter(folder: Path, rank: int) -> None:
    import torch
    from safetensors.torch import save_file

    torch.manual_seed(0)
    tensors = {}
    for layer in range(30):
        for name, (inputs, outputs) in SHAPES.items():
            part = "self_attn" if name[0] in "qkvo" else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, inputs) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(outputs, rank) * 0.02
    save_file(tensors, folder / "adapter_model.safetensors")
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(SHAPES)}
    (folder / "adapter_config.json").write_text(json.dumps(config))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        write_adapter(Path(tmp), args.rank)
        runs: dict[str, list[dict]] = {"off": [], "base": [], "adapter": []}
        for _ in range(args.rounds):
            for mode in runs:
                out = subprocess.run(
                    [sys.executable, "-c", RUN, mode, tmp], capture_output=True, text=True, check=True
                ).stdout
                runs[mode].append(json.loads(out.strip().splitlines()[-1]))
                print(json.dumps(runs[mode][-1]), flush=True)
    medians = {
        mode: {key: statistics.median(r[key] for r in results) for key in ("c1_step_ms", "c32_tok_s")}
        for mode, results in runs.items()
    }
    for mode, median in medians.items():
        off = medians["off"]
        ratios = {f"{key}_vs_off": round(median[key] / off[key], 3) for key in median}
        print(json.dumps({"median": mode, **{k: round(v, 2) for k, v in median.items()}, **ratios}))


if __name__ == "__main__":
    main()
