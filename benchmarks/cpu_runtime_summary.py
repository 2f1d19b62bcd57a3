"""The CPU-runtime targets checked against one run of benchmarks/cpu_runtime.sh: reads its folder
and prints (and writes OUT/summary.md) each target with the measured figure and whether it is met.

    python benchmarks/cpu_runtime_summary.py [OUT]    # default benchmarks/results/cpu_runtime
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path


def vllm_result(folder: Path, engine: str, name: str) -> dict | None:
    """vLLM's result file for one level; for an interleaved run (serve/ENGINE/rR/), each figure's
    median over the rounds, as serve_vs_vllm.sh's table gives it."""
    paths = sorted((folder / "serve" / engine).glob(f"r*/{name}.json")) or [folder / "serve" / engine / f"{name}.json"]
    results = [json.loads(path.read_text()) for path in paths if path.is_file()]
    if not results:
        return None
    keys = ("output_throughput", "median_ttft_ms", "median_tpot_ms")
    return {key: statistics.median(result[key] for result in results) for key in keys}


def shared_prefix_ttft(folder: Path, engine: str) -> tuple[float, list[float]] | None:
    """The shared-prefix bake-off's TTFT p50 of `engine` in ms over every round's requests pooled
    (the bake-off's rounds name it ENGINE-rR), and each round's own p50: one run's p50 can fall
    on either side of a gap between lone and paired hits, pooling the rounds steadies it."""
    path = folder / "shared_prefix" / "results.json"
    if not path.is_file():
        return None
    rounds = [
        [record["ttft_s"] * 1e3 for level in entry["levels"] for record in level["records"] if record.get("ttft_s")]
        for entry in json.loads(path.read_text())["engines"]
        if re.fullmatch(rf"{re.escape(engine)}(-r\d+)?", entry["name"])
    ]
    rounds = [ttfts for ttfts in rounds if ttfts]
    if not rounds:
        return None
    return statistics.median(t for ttfts in rounds for t in ttfts), [statistics.median(t) for t in rounds]


def rows(folder: Path) -> list[tuple[str, str, str, bool | None]]:
    """(target, measured, detail, met) for every target whose inputs exist."""
    out: list[tuple[str, str, str, bool | None]] = []
    machine = json.loads((folder / "machine.json").read_text()) if (folder / "machine.json").is_file() else {}
    floor = machine.get("default_model_fp32_decode_floor_ms")
    ceiling = machine.get("fp32_ceiling_256in_64out_tok_s")
    ours, theirs = (vllm_result(folder, e, "c1") for e in ("pagoda", "vllm"))
    if ours and theirs:
        tpot, peer = ours["median_tpot_ms"], theirs["median_tpot_ms"]
        out.append(("TPOT c=1 <= 0.7x vLLM", f"{tpot / peer:.2f}x", f"{tpot:.1f} vs {peer:.1f} ms", tpot <= 0.7 * peer))
        if floor:
            met = tpot <= 1.25 * floor
            out.append(("TPOT c=1 <= 1.25x weight-read floor", f"{tpot / floor:.2f}x", f"floor {floor:.1f} ms", met))
    ours, theirs = (vllm_result(folder, e, "c32") for e in ("pagoda", "vllm"))
    if ours and theirs:
        tps, peer = ours["output_throughput"], theirs["output_throughput"]
        detail = f"{tps:.1f} vs {peer:.1f}"
        out.append(("output tok/s c=32 >= 1.3x vLLM", f"{tps / peer:.2f}x", detail, tps >= 1.3 * peer))
        if ceiling:
            share = tps / ceiling
            detail = f"ceiling {ceiling:.0f} tok/s"
            out.append(("output tok/s c=32 >= 80% of fp32 ceiling", f"{share:.0%}", detail, share >= 0.8))
    bf16 = vllm_result(folder, "pagoda-bf16", "c32")
    if bf16 and ours:
        ratio = bf16["output_throughput"] / ours["output_throughput"]
        amx = "amx" in (machine.get("kernels_built_for") or [])
        target = "bf16 c=32 >= 2x fp32 (AMX kind)" + ("" if amx else "; no AMX here: open")
        out.append((target, f"{ratio:.2f}x", f"{bf16['output_throughput']:.1f} tok/s", ratio >= 2 if amx else None))
    ours, theirs = (vllm_result(folder, e, "long") for e in ("pagoda", "vllm"))
    if ours and theirs:
        for key, label in (("median_ttft_ms", "TTFT"), ("median_tpot_ms", "TPOT")):
            ratio = ours[key] / theirs[key]
            detail = f"{ours[key]:.0f} vs {theirs[key]:.0f} ms"
            out.append((f"4,000-token prompt {label} <= 0.8x vLLM", f"{ratio:.2f}x", detail, ratio <= 0.8))
    ours, theirs = shared_prefix_ttft(folder, "pagoda"), shared_prefix_ttft(folder, "vllm-cpu")
    if ours and theirs:
        (ttft, our_rounds), (peer, peer_rounds) = ours, theirs
        detail = f"{ttft:.0f} vs {peer:.0f} ms"
        if len(our_rounds) > 1 or len(peer_rounds) > 1:
            each = " / ".join(f"{a:.0f} vs {b:.0f}" for a, b in zip(our_rounds, peer_rounds))
            detail += f", all {len(our_rounds)} rounds' requests pooled (rounds' p50: {each} ms)"
        out.append(("shared-prefix TTFT p50 <= 0.5x vLLM", f"{ttft / peer:.2f}x", detail, ttft <= 0.5 * peer))
    if (folder / "busy_core.json").is_file():
        busy = json.loads((folder / "busy_core.json").read_text())["ratios"]
        for label, value in busy.items():
            target = float(label.rsplit(">=", 1)[1].rstrip(")"))
            out.append((f"generate, one CPU busy: {label}", f"{value:.2f}", "", value >= target))
    return out


def main() -> None:
    folder = Path(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/cpu_runtime")
    lines = ["| target | measured | detail | met |", "|---|---|---|---|"]
    for target, measured, detail, met in rows(folder):
        lines.append(f"| {target} | {measured} | {detail} | {'open' if met is None else 'yes' if met else 'no'} |")
    text = "\n".join(lines) + "\n"
    print(text)
    (folder / "summary.md").write_text(text)


if __name__ == "__main__":
    main()
