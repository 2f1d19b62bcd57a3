#!/usr/bin/env bash
# One-shot device check on a CUDA machine (an H200): correctness first, then timings.
#
#   benchmarks/gpu_check.sh            # results and logs in $OUT, else benchmarks/results/gpu_check/
#   benchmarks/gpu_check.sh --dry-run  # on CPU: kernels under Triton's interpreter, the engine parts
#                                      # with tiny shapes, the torch backend and no CUDA graphs
#
# Each part runs under its own time limit; the limits add up to at most 8 minutes. Exits non-zero
# when any part fails (a correctness failure, a crash, or running out of time), after running all.
set -uo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export OUT=${OUT:-$PWD/benchmarks/results/gpu_check}
mkdir -p "$OUT"
DRY_RUN=()
[ "${1:-}" = "--dry-run" ] && DRY_RUN=(--dry-run)

status=0
part() { # part NAME LIMIT_SECONDS COMMAND...: one part, its log in $OUT/NAME.log
    local name=$1 limit=$2 start=$SECONDS rc
    shift 2
    echo "=== $name (limit ${limit}s)"
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    rc=${PIPESTATUS[0]}
    echo "=== $name: exit $rc after $((SECONDS - start))s"
    [ "$rc" -eq 0 ] || status=1
}

[ ${#DRY_RUN[@]} -eq 0 ] && nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv

# Attention kernels: Triton against the torch reference (bf16, fp32), then decode and prefill
# timings. An estimated 1 to 2.5 minutes on an H200, most of it compiling kernel variants on a
# fresh machine; timing cases still to run at 150 s are skipped (listed in the JSON).
part gpu_kernels 180 "$PYTHON" benchmarks/gpu_kernels.py --budget 150 "${DRY_RUN[@]}"

# Engine: greedy correctness with CUDA graphs on and off (a tiny random Llama against transformers
# in fp32, graphs against eager in bf16, the FP8 product), then a Llama-3-8B-shaped model with
# random weights in bf16 and in fp8: batch-1 decode against the HBM roofline, output tokens/s and
# TTFT at concurrency 1, 16, 64 and 256, graphs on and off. Estimated 30-40 s, then 60-90 s each
# (imports, profiling, graph capture, waves); a timing part starts no case after its --budget.
part gpu_engine_correctness 60 "$PYTHON" benchmarks/gpu_engine.py correctness "${DRY_RUN[@]}"
part gpu_engine_bf16 120 "$PYTHON" benchmarks/gpu_engine.py timing --dtype bf16 --budget 95 "${DRY_RUN[@]}"
part gpu_engine_fp8 110 "$PYTHON" benchmarks/gpu_engine.py timing --dtype fp8 --budget 85 "${DRY_RUN[@]}"

echo "=== gpu_check: $([ $status -eq 0 ] && echo passed || echo FAILED) in ${SECONDS}s; results in $OUT"
exit $status
