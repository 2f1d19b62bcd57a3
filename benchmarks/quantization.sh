#!/usr/bin/env bash
# Quantized weights on the CPU (docs/quantization.md) in one run on this machine:
#  1. the CPU: model name and flags (the kernels' paths differ with AVX-512, VNNI, AMX)
#  2. quantization_accuracy.py: each format against the fp32 model on a 2,048-token text (not a timing)
#  3. quant_kernels.py: the GGUF and int8 kernels' GFLOP/s against oneDNN fp32 on the model's layer shapes (kernels.md)
#  4. quantization_speed.py: prefill tok/s (1,024-token prompt) and batch-1 decode ms/token, offline, per format
#  5. serve_vs_vllm.sh: the server at concurrency 1, 8, 32 (random 256 in / 64 out, vLLM's client) for
#     Pagoda --quantization gguf on the Q4_1 file, Pagoda --quantization int8 on the fp32 HF directory,
#     Pagoda fp32, llama.cpp's server on the same Q4_1 file, and vLLM's CPU build in fp32
# Targets (issue 15): gguf's batch-1 TPOT at or below llama.cpp's; throughput at 8 and 32 at least
# 2x vLLM-CPU fp32's (table.txt's ratio column: pagoda-gguf / vllm).
#
#   benchmarks/quantization.sh [OUT]    # default benchmarks/results/quantization; needs `pagoda` installed
#   env: ENGINES (default "pagoda-gguf pagoda-int8 pagoda llamacpp vllm"), CONCURRENCY ("1 8 32"),
#        NUM_PROMPTS, and serve_vs_vllm.sh's others; SPEED_ARGS (more quantization_speed.py flags)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-benchmarks/results/quantization}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1
{ grep -m1 "model name" /proc/cpuinfo; nproc; grep -m1 "^flags" /proc/cpuinfo; } >"$OUT/cpu.txt"
python -c "from pagoda.kernels import cpu; print('kernel build:', '+'.join(cpu.cpu_isa()))" >>"$OUT/cpu.txt"
python benchmarks/quantization_accuracy.py --out "$OUT"
python benchmarks/quant_kernels.py >"$OUT/kernels.md"
# shellcheck disable=SC2086 # SPEED_ARGS is a list of flags
python benchmarks/quantization_speed.py --json "$OUT/speed.json" ${SPEED_ARGS:-}
ENGINES=${ENGINES:-pagoda-gguf pagoda-int8 pagoda llamacpp vllm} benchmarks/serve_vs_vllm.sh "$OUT/serve"
