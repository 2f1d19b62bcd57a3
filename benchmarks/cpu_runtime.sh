#!/usr/bin/env bash
# The CPU-runtime benchmark in one run on this machine, then its targets table:
#  1. machine_limits.py: CPU kind and flags, read/GEMV/GEMM rates, the fp32 decode floor and compute ceiling
#  2. serve_vs_vllm.sh: Pagoda fp32, Pagoda bf16 and vLLM-CPU fp32 with vLLM's client (random 256 in /
#     64 out at concurrency 1, 8, 32; one 4,000-token prompt: LONG=1), interleaved over ROUNDS rounds
#     (default 3: all servers up at once, so that every ratio compares the same minutes)
#  3. the shared-prefix bake-off (benchmarks/prefix_cache/shared_prefix.toml: Pagoda with and without
#     its prefix cache, vLLM-CPU with its own), SHARED_ROUNDS rounds (default 3) in turn: the
#     summary pools their requests, as one run's TTFT p50 is noisy
#  4. busy_core.py: offline generation with one CPU kept busy, default threads vs --threads 1
#  5. cpu_runtime_summary.py: each target, measured and met or not (OUT/summary.md)
#
#   benchmarks/cpu_runtime.sh [OUT]    # default benchmarks/results/cpu_runtime; needs `pagoda` installed
#   env: ROUNDS (3), ENGINES ("pagoda pagoda-bf16 vllm"; vllm last: the ratios' denominator),
#        SHARED_ROUNDS (3)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-benchmarks/results/cpu_runtime}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1
python benchmarks/machine_limits.py --json "$OUT/machine.json"
ENGINES=${ENGINES:-pagoda pagoda-bf16 vllm} ROUNDS=${ROUNDS:-3} LONG=1 benchmarks/serve_vs_vllm.sh "$OUT/serve"
pagoda bakeoff --no-progress --rounds "${SHARED_ROUNDS:-3}" --output "$OUT/shared_prefix" benchmarks/prefix_cache/shared_prefix.toml
python benchmarks/busy_core.py --json "$OUT/busy_core.json"
python benchmarks/cpu_runtime_summary.py "$OUT"
