#!/usr/bin/env bash
# Usage: bench/fair_scenario.sh PORT NAME HEAVY_TENANTS [serve args...]
# Issue 34's shape: heavy tenant(s) keep 6 streams of 4,058-token prompts x 256 output tokens
# busy; a light tenant sends one short request a second (64-token prompt, 32 output). NAME
# labels the JSON reports in /tmp/fair/. HEAVY_TENANTS: "" (light alone), "heavy:1" or
# "heavy:1,heavy2:1". HEAVY_N=4 in the environment: each heavy request asks for n: 4.
set -u

PORT=$1; NAME=$2; HEAVY=$3; shift 3
mkdir -p /tmp/fair
treadle serve --port $PORT "$@" > /tmp/fair/$NAME.serve.log 2>&1 &
pid=$!
for i in $(seq 240); do curl -sf localhost:$PORT/health >/dev/null && break; sleep 1; done
model=$(curl -s localhost:$PORT/v1/models | python -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')
common=(--base-url http://127.0.0.1:$PORT --model "$model" --workload random --range-ratio 0 --no-progress)
if [ -n "$HEAVY" ]; then
  treadle bench serve "${common[@]}" --input-len 4058 --output-len 256 --num-prompts 12 \
    --max-concurrency 6 --tenants "$HEAVY" --n "${HEAVY_N:-1}" --seed 1 --json /tmp/fair/$NAME.heavy.json \
    > /tmp/fair/$NAME.heavy.txt 2>&1 &
  heavy=$!
  sleep 20  # the heavy streams fill the cache first
fi
treadle bench serve "${common[@]}" --input-len 64 --output-len 32 --num-prompts 60 \
  --request-rate 1 --tenants light:1 --seed 2 --json /tmp/fair/$NAME.light.json > /tmp/fair/$NAME.light.txt 2>&1
[ -n "$HEAVY" ] && wait $heavy
kill $pid; wait $pid 2>/dev/null
python - "$NAME" <<'PY'
import json, sys
name = sys.argv[1]
def load(part):
    try:
        return json.load(open(f"/tmp/fair/{name}.{part}.json"))["runs"][0]
    except FileNotFoundError:
        return None
light, heavy = load("light"), load("heavy")
t = light["ttft_ms"]
line = f"{name}: light TTFT p50 {t['median']/1e3:.3f} s p99 {t['p99']/1e3:.3f} s ok {light['successful']}"
if heavy:
    line += f"; heavy {heavy['successful']} ok in {heavy['duration_s']:.1f} s, {heavy['output_throughput']:.1f} tok/s"
print(line)
PY
