#!/usr/bin/env bash
# What deterministic serving costs: `pagoda serve` on the default model (fp32, CPU) with
# --deterministic and with --no-deterministic, alternated back to back in PAIRS pairs (on, off, on,
# off, ...), each server with the machine to itself, driven by `pagoda bench` (random 256 in / 64
# out, ignore_eos, seed 0) at each level of CONCURRENCY; the prefix cache is reset before each level.
# LONG=1 adds one 4,000-token prompt at a time (32 out): the long prefill is where the invariant
# attention kernel differs most from SDPA. The on/off ratios of the medians decide the default
# (DETERMINISTIC_BY_DEFAULT in pagoda/engine/args.py: on where the cost is at most 10%).
#
#   benchmarks/determinism.sh [OUT_DIR]   # env: PAIRS (3), CONCURRENCY ("1 8 32"), NUM_PROMPTS
#                                         # (max(16, 4 x concurrency) per level), OUTPUT_LEN (64),
#                                         # PORT (18500), KV_GIB (4), LONG (0), LONG_PROMPTS (4)
# Writes OUT_DIR/{on,off}-{pair}/c{C}/ (pagoda bench's report) and server.log, and OUT_DIR/table.md:
# every run, then on/off of the medians. OUT_DIR defaults to benchmarks/results/determinism.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-$PWD/benchmarks/results/determinism}
PAIRS=${PAIRS:-3}
CONCURRENCY=${CONCURRENCY:-1 8 32}
OUTPUT_LEN=${OUTPUT_LEN:-64}
PORT=${PORT:-18500}
KV_GIB=${KV_GIB:-4}
LONG=${LONG:-0}
MAX_MODEL_LEN=$([ "$LONG" = 1 ] && echo 8192 || echo 2048)
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
URL=http://127.0.0.1:$PORT
mkdir -p "$OUT"

. benchmarks/server_process.sh
trap stop_server EXIT

bench_level() {  # DIR LABEL CONCURRENCY INPUT_LEN OUTPUT_LEN NUM_PROMPTS
  curl -sf -X POST "$URL/reset_prefix_cache" >/dev/null
  python -m pagoda.entrypoints.cli bench --base-url "$URL" --workload random --input-len "$4" --output-len "$5" \
    --concurrency "$3" --num-prompts "$6" --seed 0 --warmup 1 --no-progress --output "$1/$2" >"$1/bench-$2.log" 2>&1 \
    || { tail -20 "$1/bench-$2.log" >&2; exit 1; }
}

run_side() {  # run_side MODE DIR: MODE is "on" or "off"
  local flag dir=$2
  flag=$([ "$1" = on ] && echo --deterministic || echo --no-deterministic)
  mkdir -p "$dir"
  setsid python -m pagoda.entrypoints.cli serve --port "$PORT" --max-model-len "$MAX_MODEL_LEN" \
    --kv-cache-memory "$KV_GIB" "$flag" >"$dir/server.log" 2>&1 &
  SERVER=$!
  until curl -sf -m 2 "$URL/v1/models" >/dev/null; do
    kill -0 "$SERVER" 2>/dev/null || { tail -20 "$dir/server.log" >&2; exit 1; }
    sleep 1
  done
  grep -q "deterministic $1)" "$dir/server.log" || { echo "the server did not start with deterministic $1" >&2; exit 1; }
  for c in $CONCURRENCY; do
    bench_level "$dir" "c$c" "$c" 256 "$OUTPUT_LEN" "${NUM_PROMPTS:-$((c * 4 > 16 ? c * 4 : 16))}"
  done
  if [ "$LONG" = 1 ]; then bench_level "$dir" long 1 4000 32 "${LONG_PROMPTS:-4}"; fi
  stop_server
  echo "[$1] pair done: $dir" >&2
}

for pair in $(seq "$PAIRS"); do
  run_side on "$OUT/on-$pair"
  run_side off "$OUT/off-$pair"
done

LEVELS=$(for c in $CONCURRENCY; do echo -n "c$c "; done)
if [ "$LONG" = 1 ]; then LEVELS+=long; fi
python - "$OUT" "$PAIRS" "$(git rev-parse --short HEAD)" $LEVELS <<'EOF' | tee "$OUT/table.md"
import csv, statistics, sys
from pathlib import Path

out, pairs, head, levels = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4:]
metrics = [("output tok/s", "output_throughput"), ("TPOT p50 ms", "tpot_median_ms"), ("TTFT p50 ms", "ttft_median_ms")]
def read(side: str, pair: int, level: str) -> dict:
    (row,) = list(csv.DictReader((out / f"{side}-{pair}" / level / "results.csv").open()))
    return row
runs = [(s, p) for p in range(1, pairs + 1) for s in ("on", "off")]
print(f"# Deterministic serving on and off ({head}), {pairs} alternating pairs\n")
print("| level | metric | " + " | ".join(f"{s} {p}" for s, p in runs) + " | on/off (medians) |")
print("|---" * (len(runs) + 3) + "|")
for level in levels:
    for label, key in metrics:
        values = {(s, p): float(read(s, p, level)[key]) for s, p in runs}
        on = statistics.median(values["on", p] for p in range(1, pairs + 1))
        off = statistics.median(values["off", p] for p in range(1, pairs + 1))
        cells = " | ".join(f"{values[r]:.1f}" for r in runs)
        print(f"| {level} | {label} | {cells} | {on / off:.3f} |")
print("\nCost: 1 - on/off of output tok/s, or on/off - 1 of TPOT; the default is on where it is at most 10%.")
EOF
