#!/usr/bin/env bash
# Pagoda's server beside vLLM's CPU build, one after the other on this machine: the same model
# and dtype (SmolLM2-135M-Instruct, the fp32 HF directory from smollm2-hf.sh), the same context
# and KV budget, the same client (vLLM's own `vllm bench serve`: random 256 in / 64 out,
# ignore_eos, seed 0) at concurrency 1, 8 and 32; the prefix cache is reset before each level.
# Also cold start: process start until the first request is answered. LONG=1 adds a long-context
# level: random 4,000 in / 32 out at concurrency 1 (LONG_PROMPTS of them, default 4), with a
# context of 8,192 for both engines unless MAX_MODEL_LEN says otherwise. ROUNDS=N (N > 1) starts
# every engine at once (each its own port, PORT, PORT + 1, ..; all but one idle at any time) and
# runs the levels N times, the engines' order reversed every other round, so that each engine's
# runs are spread over the same minutes: the table then holds each engine's median over rounds and
# the ratio of the medians, plus each round's output tok/s ratios (a shared machine's speed drifts
# within minutes more than one engine differs from another).
#
#   benchmarks/serve_vs_vllm.sh [OUT_DIR]    # default benchmarks/results/serve_vs_vllm
#   env: ENGINES="pagoda vllm" (default; also pagoda-bf16: --dtype bfloat16; pagoda-gguf: the Q4_1 file with
#        --quantization gguf; pagoda-int8: the HF directory with --quantization int8; llamacpp: llama.cpp's
#        server on the Q4_1 file (llamacpp.sh's venv, through llamacpp_server.py; N_THREADS (1) and N_THREADS_BATCH (2)
#        as llamacpp.sh; LLAMACPP_PYTHON: another llama-cpp-python build's python, e.g. one built without AMX
#        where llama.cpp's AMX path faults); each runs with the machine to itself; ratios are the first over the last),
#        CONCURRENCY="1 8 32", NUM_PROMPTS (default: max(16, 4 x concurrency) per level),
#        PAGODA_ARGS (more flags for the pagoda engine), PORT (18300), KV_GIB (4), MAX_MODEL_LEN (2048; 8192 with LONG=1), LONG (0), LONG_PROMPTS (4),
#        SERVER_NICENESS (the bench launcher's, 10: each server's nice value above the client's; 0: the same),
#        MODEL_DIR (another float32 HF directory for pagoda and vllm, e.g. moe_model.py's mixture of experts)
#
# Needs ../shared/peers (vllm-cpu.sh installs vLLM on first use). Each server runs in its own
# process group and is stopped (SIGTERM, then SIGKILL) when its half ends, however it ends.
# Results: OUT_DIR/ENGINE/c{C}.json and long.json (vLLM's result files; with ROUNDS, OUT_DIR/ENGINE/rR/..
# for round R), OUT_DIR/ENGINE/cold_start_s,
# OUT_DIR/ENGINE/server.log, and the table in OUT_DIR/table.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
PEERS=${PEERS:-$(cd .. && pwd)/shared/peers}
OUT=${1:-$PWD/benchmarks/results/serve_vs_vllm}
ENGINES=${ENGINES:-pagoda vllm}
CONCURRENCY=${CONCURRENCY:-1 8 32}
PORT=${PORT:-18300}
LONG=${LONG:-0}
ROUNDS=${ROUNDS:-1}
# The servers run this much nicer than the client, by the value pagoda bench/bakeoff launch them with
# (pagoda/bench/launcher.py): on a machine they share, a server's compute threads otherwise keep the
# client from sending on time, and a closed loop bunches (docs/bench.md). 0: the client's priority.
SERVER_NICENESS=${SERVER_NICENESS:-$(python -c 'from pagoda.bench.launcher import SERVER_NICENESS; print(SERVER_NICENESS)')}
export KV_GIB=${KV_GIB:-4} MAX_MODEL_LEN=${MAX_MODEL_LEN:-$([ "$LONG" = 1 ] && echo 8192 || echo 2048)}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
NAME=smollm2
URL=http://127.0.0.1:$PORT
MODEL_DIR=${MODEL_DIR:-$("$PEERS/smollm2-hf.sh")}
export MODEL=$MODEL_DIR  # vllm-cpu.sh's
GGUF_FILE=$(. "$PEERS/common.sh" && smollm2_gguf)  # the Q4_1 file llamacpp.sh serves
LLAMACPP_PYTHON=${LLAMACPP_PYTHON:-$(. "$PEERS/common.sh" && echo "$PEERS_HOME/llamacpp-venv/bin/python")}
case " $ENGINES " in *" llamacpp "*) "$PEERS/llamacpp.sh" install ;; esac
mkdir -p "$OUT"

now() { date +%s.%N; }

server_command() {  # the engine's serve command, same model, dtype, context and KV budget (on $PORT)
  case "$1" in
    pagoda) echo python -m pagoda.entrypoints.cli serve "$MODEL_DIR" --port "$PORT" --dtype float32 \
              --served-model-name "$NAME" --max-model-len "$MAX_MODEL_LEN" --kv-cache-memory "$KV_GIB" ${PAGODA_ARGS:-} ;;
    pagoda-bf16) echo python -m pagoda.entrypoints.cli serve "$MODEL_DIR" --port "$PORT" --dtype bfloat16 \
              --served-model-name "$NAME" --max-model-len "$MAX_MODEL_LEN" --kv-cache-memory "$KV_GIB" ;;
    pagoda-gguf) echo python -m pagoda.entrypoints.cli serve "$GGUF_FILE" --port "$PORT" \
              --quantization gguf --served-model-name "$NAME" --max-model-len "$MAX_MODEL_LEN" --kv-cache-memory "$KV_GIB" ;;
    pagoda-int8) echo python -m pagoda.entrypoints.cli serve "$MODEL_DIR" --port "$PORT" --quantization int8 \
              --served-model-name "$NAME" --max-model-len "$MAX_MODEL_LEN" --kv-cache-memory "$KV_GIB" ;;
    vllm) echo "$PEERS/vllm-cpu.sh" serve "$PORT" --served-model-name "$NAME" --max-model-len "$MAX_MODEL_LEN" ;;
    llamacpp) echo "$LLAMACPP_PYTHON" benchmarks/llamacpp_server.py --model "$GGUF_FILE" --host 127.0.0.1 \
              --port "$PORT" --n_ctx "$MAX_MODEL_LEN" --n_threads "${N_THREADS:-1}" --n_threads_batch "${N_THREADS_BATCH:-2}" \
              --interrupt_requests False --model_alias "$NAME" ;;
    *) echo "unknown engine $1" >&2; exit 2 ;;
  esac
}

. benchmarks/server_process.sh
SERVERS=()  # with ROUNDS: every engine's process group, all running at once
stop_servers() {
  for SERVER in "${SERVERS[@]}"; do stop_server; done
  stop_server
}
trap stop_servers EXIT

first_answer() {  # one completion of one token; fails until the server answers
  curl -sf -m 60 "$URL/v1/completions" -H 'Content-Type: application/json' \
    -d "{\"model\": \"$NAME\", \"prompt\": \"Hello\", \"max_tokens\": 1}" >/dev/null
}

bench_level() {  # ENGINE LABEL CONCURRENCY INPUT_LEN OUTPUT_LEN NUM_PROMPTS [DIR] -> DIR/LABEL.json (DIR: $OUT/ENGINE)
  local engine=$1 label=$2 c=$3 dir=${7:-$OUT/$1}
  mkdir -p "$dir"
  curl -sf -X POST "$URL/reset_prefix_cache" >/dev/null || echo "[$engine] could not reset the prefix cache" >&2
  "$PEERS/vllm-cpu.sh" bench --backend openai --base-url "$URL" --model "$NAME" --tokenizer "$MODEL_DIR" \
    --dataset-name random --random-input-len "$4" --random-output-len "$5" --ignore-eos \
    --max-concurrency "$c" --num-prompts "$6" --seed 0 \
    --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,99 --disable-tqdm \
    --save-result --result-dir "$dir" --result-filename "$label.json" >"$dir/bench-$label.log" 2>&1 \
    || { tail -20 "$dir/bench-$label.log" >&2; exit 1; }
  echo "[$engine] $label done" >&2
}

start_engine() {  # starts ENGINE on $PORT and waits for its first answer; $SERVER its process group
  local engine=$1 dir=$OUT/$1 started
  mkdir -p "$dir"
  started=$(now)
  # shellcheck disable=SC2046 # the command is split into words on purpose
  setsid nice -n "$SERVER_NICENESS" $(server_command "$engine") >"$dir/server.log" 2>&1 &
  SERVER=$!
  echo "[$engine] starting (log: $dir/server.log)" >&2
  until first_answer; do
    kill -0 "$SERVER" 2>/dev/null || { tail -20 "$dir/server.log" >&2; exit 1; }
    sleep 0.5
  done
  python -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f}')" "$started" "$(now)" \
    | tee "$dir/cold_start_s" | sed "s/^/[$engine] cold start s: /" >&2
}

bench_levels() {  # ENGINE [DIR]: every level against the server at $URL
  for c in $CONCURRENCY; do
    bench_level "$1" "c$c" "$c" 256 64 "${NUM_PROMPTS:-$((c * 4 > 16 ? c * 4 : 16))}" "${2:-}"
  done
  if [ "$LONG" = 1 ]; then bench_level "$1" long 1 4000 32 "${LONG_PROMPTS:-4}" "${2:-}"; fi
}

if [ "$ROUNDS" -le 1 ]; then
  for engine in $ENGINES; do
    start_engine "$engine"
    bench_levels "$engine"
    stop_server
  done
else
  read -ra ORDER <<<"$ENGINES"
  BASE_PORT=$PORT
  for i in "${!ORDER[@]}"; do
    PORT=$((BASE_PORT + i)) URL=http://127.0.0.1:$((BASE_PORT + i))
    start_engine "${ORDER[$i]}"
    SERVERS+=("$SERVER")
    SERVER=""
  done
  for r in $(seq "$ROUNDS"); do
    idx=("${!ORDER[@]}")
    if [ $((r % 2)) = 0 ]; then idx=($(printf '%s\n' "${idx[@]}" | tac)); fi
    for i in "${idx[@]}"; do
      URL=http://127.0.0.1:$((BASE_PORT + i))
      bench_levels "${ORDER[$i]}" "$OUT/${ORDER[$i]}/r$r"
    done
  done
fi

LEVELS=$(for c in $CONCURRENCY; do echo -n "c$c "; done)
if [ "$LONG" = 1 ]; then LEVELS+=long; fi
python - "$OUT" "$LEVELS" "$ROUNDS" $ENGINES <<'EOF' | tee "$OUT/table.txt"
import json, statistics, sys
from pathlib import Path

out, levels, rounds, engines = Path(sys.argv[1]), sys.argv[2].split(), int(sys.argv[3]), sys.argv[4:]
runs = [""] if rounds <= 1 else [f"r{r}/" for r in range(1, rounds + 1)]  # a level's result files, per round
rows = [("cold start s", None, lambda e: float((out / e / "cold_start_s").read_text()))]
for level in levels:  # c1, c8, ...: 256 in / 64 out at that concurrency; long: 4,000 in / 32 out at 1
    c = "1 long" if level == "long" else level[1:]

    def field(key, level=level):  # the median over rounds
        return lambda e: statistics.median(json.loads((out / e / f"{r}{level}.json").read_text())[key] for r in runs)

    rows += [("output tok/s", c, field("output_throughput")), ("TTFT p50 ms", c, field("median_ttft_ms")),
             ("TTFT p99 ms", c, field("p99_ttft_ms")), ("TPOT p50 ms", c, field("median_tpot_ms"))]
ratio = len(engines) >= 2  # the first engine over the last
print(f"{'metric':<14}{'conc':>7}" + "".join(f"{e:>12}" for e in engines) + (f"{'ratio':>9}" if ratio else ""))
for label, c, read in rows:
    values = [read(e) for e in engines]
    line = f"{label:<14}{c or '':>7}" + "".join(f"{v:>12.1f}" for v in values)
    print(line + (f"{values[0] / values[-1]:>8.2f}x" if ratio and values[-1] else ""))
if ratio:
    print(f"(ratio: {engines[0]} / {engines[-1]}; above 1 is better for tok/s, worse for times)")
if rounds > 1:
    print(f"(each engine's median over {rounds} rounds; output tok/s ratio round by round:)")
    for level in levels:
        tok = [[json.loads((out / e / f"{r}{level}.json").read_text())["output_throughput"] for r in runs] for e in engines]
        print(f"  {level}: " + " ".join(f"{a / b:.2f}x" for a, b in zip(tok[0], tok[-1])))
EOF
