#!/usr/bin/env bash
# Structured outputs on Pagoda and on vLLM's CPU build, one after the other on this machine: the same
# fp32 SmolLM2 directory, context and KV budget, driven by benchmarks/structured_outputs.py (TPOT with
# and without a JSON-schema constraint at concurrency 1 and 8, the share of valid outputs, and the
# first-request latency of a new schema against a cached one).
#
#   benchmarks/structured_outputs.sh [OUT_DIR]   # default benchmarks/results/structured_outputs
#   env: ENGINES="pagoda vllm", CONCURRENCY (1,8), NUM_REQUESTS (16), PORT (18500), KV_GIB (4)
#
# Needs ../shared/peers (vllm-cpu.sh installs vLLM on first use). Writes OUT_DIR/ENGINE.json and
# OUT_DIR/ENGINE.log.
set -euo pipefail
cd "$(dirname "$0")/.."
PEERS=${PEERS:-$(cd .. && pwd)/shared/peers}
OUT=${1:-$PWD/benchmarks/results/structured_outputs}
ENGINES=${ENGINES:-pagoda vllm}
PORT=${PORT:-18500}
export KV_GIB=${KV_GIB:-4} HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
MODEL_DIR=$("$PEERS/smollm2-hf.sh")
URL=http://127.0.0.1:$PORT
mkdir -p "$OUT"

. benchmarks/server_process.sh
trap stop_server EXIT

for engine in $ENGINES; do
  case "$engine" in
    pagoda) setsid python -m pagoda.entrypoints.cli serve "$MODEL_DIR" --port "$PORT" --dtype float32 \
              --served-model-name smollm2 --max-model-len 2048 --kv-cache-memory "$KV_GIB" >"$OUT/$engine.log" 2>&1 & ;;
    vllm) setsid "$PEERS/vllm-cpu.sh" serve "$PORT" --served-model-name smollm2 --max-model-len 2048 \
              >"$OUT/$engine.log" 2>&1 & ;;
    *) echo "unknown engine $engine" >&2; exit 2 ;;
  esac
  SERVER=$!
  for _ in $(seq 600); do curl -sf -m 2 "$URL/v1/models" >/dev/null && break; sleep 1; done
  python benchmarks/structured_outputs.py --base-url "$URL" --concurrency "${CONCURRENCY:-1,8}" \
    --num-requests "${NUM_REQUESTS:-16}" --output "$OUT/$engine.json"
  stop_server
done
