#!/usr/bin/env bash
# Did a change make Pagoda slower? Two versions of Pagoda, alternated back to back in pairs on one
# machine: the working tree ("after") and a base commit ("before", checked out into a temporary
# worktree). Each side runs, with the machine to itself:
#   - offline: benchmarks/offline_throughput.py --pagoda-only (32 prompts, and batch 1), fp32;
#   - server: `pagoda serve` on the default model, driven by this tree's `pagoda bench` (random
#     256 in / 64 out, ignore_eos) at concurrency 1 (C1_PROMPTS requests) and 32 (C32_PROMPTS).
# The same scripts and client drive both sides: only the `pagoda` package differs (PYTHONPATH).
#
#   benchmarks/before_after.sh BASE_REV [OUT_DIR]   # env: PAIRS (2), PORT (18400), C1_PROMPTS (12),
#                                                   #      C32_PROMPTS (64)
# Writes OUT_DIR/{before,after}-{pair}/ (offline.json, c1/, c32/, server.log) and OUT_DIR/table.md
# (every run and the after/before ratios of the medians). OUT_DIR defaults to
# benchmarks/results/before_after.
set -euo pipefail
cd "$(dirname "$0")/.."
BASE_REV=${1:?usage: benchmarks/before_after.sh BASE_REV [OUT_DIR]}
OUT=${2:-$PWD/benchmarks/results/before_after}
PAIRS=${PAIRS:-2}
PORT=${PORT:-18400}
C1_PROMPTS=${C1_PROMPTS:-12}
C32_PROMPTS=${C32_PROMPTS:-64}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
URL=http://127.0.0.1:$PORT
HERE=$PWD
BASE=$(mktemp -d /tmp/pagoda-base.XXXXXX)
mkdir -p "$OUT"

SERVER=""
cleanup() {
  [ -n "$SERVER" ] && { kill -TERM -- "-$SERVER" 2>/dev/null || true; sleep 2; kill -KILL -- "-$SERVER" 2>/dev/null || true; }
  git worktree remove --force "$BASE" 2>/dev/null || rm -rf "$BASE"
}
trap cleanup EXIT
git worktree add --detach -q "$BASE" "$BASE_REV"

run_side() {  # run_side SRC DIR: every workload with the `pagoda` package from SRC
  local src=$1 dir=$2
  mkdir -p "$dir"
  PYTHONPATH=$src python benchmarks/offline_throughput.py --pagoda-only --output "$dir/offline.json"
  PYTHONPATH=$src setsid python -m pagoda.entrypoints.cli serve --port "$PORT" --max-model-len 2048 \
    --kv-cache-memory 4 >"$dir/server.log" 2>&1 &
  SERVER=$!
  for _ in $(seq 300); do curl -sf -m 2 "$URL/v1/models" >/dev/null && break; sleep 1; done
  python -m pagoda.entrypoints.cli bench --base-url "$URL" --workload random --input-len 256 --output-len 64 \
    --concurrency 1 --num-prompts "$C1_PROMPTS" --warmup 1 --no-progress --output "$dir/c1"
  python -m pagoda.entrypoints.cli bench --base-url "$URL" --workload random --input-len 256 --output-len 64 \
    --concurrency 32 --num-prompts "$C32_PROMPTS" --warmup 1 --no-progress --output "$dir/c32"
  kill -TERM -- "-$SERVER"
  wait "$SERVER" 2>/dev/null || true
  SERVER=""
}

for pair in $(seq "$PAIRS"); do
  run_side "$BASE" "$OUT/before-$pair"
  run_side "$HERE" "$OUT/after-$pair"
done

python - "$OUT" "$PAIRS" "$BASE_REV" "$(git rev-parse --short HEAD)" <<'EOF'
import csv, json, statistics, sys
from pathlib import Path

out, pairs, base, head = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
def figures(side: Path) -> dict[str, float]:
    offline = {r["workload"]: r["pagoda_tok_s"] for r in json.loads((side / "offline.json").read_text())["rows"]}
    row = {"offline 32 prompts tok/s": offline["32 prompts"], "offline batch 1 tok/s": offline["batch 1"]}
    for level in ("c1", "c32"):
        (result,) = list(csv.DictReader((side / level / "results.csv").open()))
        row[f"server {level} output tok/s"] = float(result["output_throughput"])
        row[f"server {level} TPOT p50 ms"] = float(result["tpot_median_ms"])
    return row
runs = {(s, p): figures(out / f"{s}-{p}") for p in range(1, pairs + 1) for s in ("before", "after")}
keys = list(next(iter(runs.values())))
lines = [f"# Before ({base}) and after ({head}), {pairs} alternating pairs", "",
         "| metric | " + " | ".join(f"{s} {p}" for p in range(1, pairs + 1) for s in ("before", "after"))
         + " | after/before (medians) |", "|---" * (2 * pairs + 2) + "|"]
for k in keys:
    b = statistics.median(runs["before", p][k] for p in range(1, pairs + 1))
    a = statistics.median(runs["after", p][k] for p in range(1, pairs + 1))
    cells = " | ".join(f"{runs[s, p][k]:.1f}" for p in range(1, pairs + 1) for s in ("before", "after"))
    lines.append(f"| {k} | {cells} | {a / b:.3f} |")
(out / "table.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
