#!/usr/bin/env bash
# Speculative decoding (n-gram prompt lookup) against speculation off, on one machine, through
# vLLM's own client (`vllm bench serve`, as serve_vs_vllm.sh). Two workloads:
#   edit:   rename a variable in a real function of this repository and reply with the whole code
#           (the answer repeats the prompt: where n-gram lookup shines), greedy, up to 256 tokens
#   random: random 256 in / 64 out, ignore_eos (the no-regression check)
# at EDIT_CONCURRENCY (1 8) and RANDOM_CONCURRENCY (1 8 32). Modes alternate within each of
# ROUNDS rounds (default 3: three on/off pairs per level), each mode its own server start.
#
#   benchmarks/spec_decode.sh [OUT_DIR]     # default benchmarks/results/spec_decode
#   env: SPEC (the JSON for --speculative-config; default ngram, k=4, lookup 2..4), ROUNDS (3),
#        MODES ("pagoda-off pagoda-ngram"; add "vllm-off vllm-ngram" for vLLM's CPU build with the
#        same --speculative-config; "pagoda-draft": the default model's 4-bit GGUF, served natively,
#        drafting for the fp32 model, with DRAFT_SPEC), EDIT_CONCURRENCY, RANDOM_CONCURRENCY, EDIT_PROMPTS (32),
#        NUM_PROMPTS (random: max(16, 4 x concurrency)), PORT (18400), KV_GIB (4), MAX_MODEL_LEN (2048)
#   quick check: ROUNDS=1 EDIT_CONCURRENCY=1 RANDOM_CONCURRENCY=1 EDIT_PROMPTS=2 NUM_PROMPTS=2 benchmarks/spec_decode.sh /tmp/sd
#
# Results: OUT_DIR/MODE/rN/LEVEL.json (vLLM's result files), LEVEL.spec (the spec-decode counters
# the level added, from the server's /metrics), server logs, and the table in OUT_DIR/table.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
PEERS=${PEERS:-$(cd .. && pwd)/shared/peers}
OUT=${1:-$PWD/benchmarks/results/spec_decode}
SPEC=${SPEC:-'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}'}
GGUF=$(python -c 'from pagoda.model_files import default_model_path; print(default_model_path())')
DRAFT_SPEC=${DRAFT_SPEC:-"{\"model\": \"$GGUF\", \"quantization\": \"gguf\", \"num_speculative_tokens\": 3}"}
ROUNDS=${ROUNDS:-3}
MODES=${MODES:-pagoda-off pagoda-ngram}
EDIT_CONCURRENCY=${EDIT_CONCURRENCY:-1 8}
RANDOM_CONCURRENCY=${RANDOM_CONCURRENCY:-1 8 32}
PORT=${PORT:-18400}
export KV_GIB=${KV_GIB:-4} MAX_MODEL_LEN=${MAX_MODEL_LEN:-2048}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
NAME=smollm2
URL=http://127.0.0.1:$PORT
MODEL_DIR=$("$PEERS/smollm2-hf.sh")
mkdir -p "$OUT"
python benchmarks/spec_decode_data.py dataset "$OUT/edit.json" "${EDIT_PROMPTS:-32}"

server_command() {  # MODE -> the serve command: same model, dtype, context and KV budget
  case "$1" in
    pagoda-off) echo python -m pagoda.entrypoints.cli serve "$MODEL_DIR" --port "$PORT" --dtype float32 \
              --served-model-name "$NAME" --max-model-len "$MAX_MODEL_LEN" --kv-cache-memory "$KV_GIB" ;;
    pagoda-ngram | pagoda-draft) echo "$(server_command pagoda-off)" --speculative-config ;;
    vllm-off) echo "$PEERS/vllm-cpu.sh" serve "$PORT" --served-model-name "$NAME" --max-model-len "$MAX_MODEL_LEN" ;;
    vllm-ngram) echo "$(server_command vllm-off)" --speculative-config ;;
    *) echo "unknown mode $1" >&2; exit 2 ;;
  esac
}

. benchmarks/server_process.sh
trap stop_server EXIT

spec_counters() {  # the server's cumulative spec-decode counters as JSON (zeros where it has none)
  curl -sf "$URL/metrics" | python -c '
import json, sys
totals = {"drafts": 0.0, "draft_tokens": 0.0, "accepted": 0.0}
names = {"num_drafts": "drafts", "num_draft_tokens": "draft_tokens", "num_accepted_tokens": "accepted"}
for line in sys.stdin:
    for name, key in names.items():
        for prefix in ("pagoda:", "vllm:"):
            metric = f"{prefix}spec_decode_{name}_total"
            if line.startswith(metric + "{") or line.startswith(metric + " "):
                totals[key] += float(line.rsplit(" ", 1)[1])
print(json.dumps(totals))'
}

bench_level() {  # DIR LABEL CONCURRENCY vllm-bench-dataset-args...
  local dir=$1 label=$2 c=$3 before after
  shift 3
  curl -sf -X POST "$URL/reset_prefix_cache" >/dev/null || echo "could not reset the prefix cache" >&2
  before=$(spec_counters)
  "$PEERS/vllm-cpu.sh" bench --base-url "$URL" --model "$NAME" --tokenizer "$MODEL_DIR" \
    --max-concurrency "$c" --seed 0 --temperature 0 "$@" \
    --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,99 --disable-tqdm \
    --save-result --result-dir "$dir" --result-filename "$label.json" >"$dir/bench-$label.log" 2>&1 \
    || { tail -20 "$dir/bench-$label.log" >&2; exit 1; }
  after=$(spec_counters)
  python -c 'import json, sys; b, a = json.loads(sys.argv[1]), json.loads(sys.argv[2]); print(json.dumps({k: a[k] - b[k] for k in a}))' \
    "$before" "$after" >"$dir/$label.spec"
  echo "[$dir] $label done" >&2
}

run_mode() {  # MODE ROUND
  local mode=$1 dir=$OUT/$1/r$2 c
  mkdir -p "$dir"
  # shellcheck disable=SC2046 # the command is split into words on purpose
  case "$mode" in
    *-ngram) setsid $(server_command "$mode") "$SPEC" >"$dir/server.log" 2>&1 & ;;
    *-draft) setsid $(server_command "$mode") "$DRAFT_SPEC" >"$dir/server.log" 2>&1 & ;;
    *) setsid $(server_command "$mode") >"$dir/server.log" 2>&1 & ;;
  esac
  SERVER=$!
  echo "[$mode] round $2 starting (log: $dir/server.log)" >&2
  until curl -sf -m 60 "$URL/v1/completions" -H 'Content-Type: application/json' \
      -d "{\"model\": \"$NAME\", \"prompt\": \"Hello\", \"max_tokens\": 1}" >/dev/null; do
    kill -0 "$SERVER" 2>/dev/null || { echo "[$mode] the server exited:" >&2; tail -20 "$dir/server.log" >&2; SERVER=""; return 0; }
    sleep 0.5
  done
  for c in $EDIT_CONCURRENCY; do
    bench_level "$dir" "edit-c$c" "$c" --backend openai-chat --endpoint /v1/chat/completions \
      --dataset-name sharegpt --dataset-path "$OUT/edit.json" --sharegpt-output-len 256 --num-prompts "${EDIT_PROMPTS:-32}"
  done
  for c in $RANDOM_CONCURRENCY; do
    bench_level "$dir" "random-c$c" "$c" --backend openai --dataset-name random --random-input-len 256 --random-output-len 64 \
      --ignore-eos --num-prompts "${NUM_PROMPTS:-$((c * 4 > 16 ? c * 4 : 16))}"
  done
  stop_server
}

for round in $(seq "$ROUNDS"); do
  # alternate which mode goes first, so that a drift of the machine does not favour one
  modes=$MODES
  [ $((round % 2)) = 0 ] && modes=$(echo "$MODES" | tr ' ' '\n' | tac | tr '\n' ' ')
  for mode in $modes; do run_mode "$mode" "$round"; done
done
python benchmarks/spec_decode_data.py table "$OUT" | tee "$OUT/table.txt"
