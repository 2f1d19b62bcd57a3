#!/bin/bash
# usage: ab.sh label envval round
cd /work/main
label=$1; val=$2; r=$3
pagoda serve --host 127.0.0.1 --port 8131 --prefill-alone-threshold $val > /tmp/trace/ab_${label}_$r.log 2>&1 &
pid=$!
for i in $(seq 60); do curl -sf http://127.0.0.1:8131/health >/dev/null && break; sleep 1; done
pagoda bench --base-url http://127.0.0.1:8131 --workload shared-prefix --endpoint chat --groups 8 --prompts-per-group 8 --system-prompt-len 1024 --question-len 32 --output-len 32 --concurrency 8 --warmup 0 --seed 0 --no-progress --output /tmp/trace/ab_${label}_$r > /dev/null 2>&1
kill $pid; wait $pid 2>/dev/null
python - <<PY
import json
d=json.load(open('/tmp/trace/ab_${label}_$r/results.json'))
lv=d['engines'][0]['levels'][0]; r=lv['records']
t=sorted(x['ttft_s'] for x in r); tp=sorted(x['tpot_s'] for x in r if x['tpot_s'])
import statistics as st
print("$label r$r", 'ttft p50 %.0f'%(st.median(t)*1000), 'tpot p50 %.1f'%(st.median(tp)*1000), 'tok/s %.1f'%lv['summary'].get('output_throughput', 0) if isinstance(lv['summary'],dict) else '')
PY
