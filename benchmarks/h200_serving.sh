#!/usr/bin/env bash
# The offline `rlt bench`, then `rlt bench --url` against `rlt serve` on the same workload, on one
# H200 (Ouro-1.4B config, dummy bf16 weights), for the HTTP path's overhead (issue 11). Offline
# first: it is the reference of the ratio, and it fills Triton's kernel cache for the server.
# The runs come in order of importance (c=8 first), so a run cut short still has the ratio.
#
#   bash benchmarks/h200_serving.sh [OUT_DIR]      (default: $OUT, else ./h200-serving-out)
#
# Writes into OUT_DIR: inprocess.jsonl (benchmarks/bench_serving_inprocess.py: the same runs
# against the AsyncEngine without HTTP), serving.jsonl (one `rlt bench --url --json` report a
# line, each with a "run" label and the server's own means over the run, from /metrics deltas,
# added), offline.json (`rlt bench --json`), server.log, cpu.txt (the server's CPU
# seconds per thread over each serving run: the main thread runs the event loop, the others the
# engine), metrics_c8.txt (/metrics after the c=8 run) and meta.txt (GPU, versions).
# Packages the image lacks (fastapi, uvicorn, pydantic, aiohttp, ...) may travel as wheels in .whl/.
# QUICK=1: a dry run of the script itself on a CPU (demo model, 2 requests a run, 4 tokens).
# SHORT=1: only the c=8, c=1 and 16 req/s runs; SERVE_ONLY=1: the HTTP runs alone (no offline
# or in-process reference); SERVE_EXTRA="--decode-window 4": more server (and in-process) flags.
# An A/B of two builds in one device call: two runs with SHORT=1 SERVE_ONLY=1 and PORTs apart.
set -uo pipefail
OUT_DIR=${1:-${OUT:-h200-serving-out}}
mkdir -p "$OUT_DIR"
PY=${PYTHON:-python3}
PORT=${PORT:-8000}
URL=http://127.0.0.1:$PORT
MODEL=tests/fixtures/ouro-1.4b
SERVE_ARGS=(--load-format dummy --max-num-seqs 256)
OFFLINE_ARGS=(--load-format dummy -c 1,8,64)
INPROCESS_RUNS=c8:64,c1:8,c64:512,r16:48,r64:192,r4:12
OUTPUT_LEN=32
# SHORT=1: only the c=8, c=1 and 16 req/s runs (an A/B in one device call)
[ "${SHORT:-0}" = 1 ] && INPROCESS_RUNS=c8:64,c1:8,r16:48
if [ "${QUICK:-0}" = 1 ]; then
  MODEL=demo
  SERVE_ARGS=(--max-num-seqs 16 --dtype float32 --device cpu)
  OFFLINE_ARGS=(-c 1,2 --dtype float32 --device cpu --repeats 1 --warmup 0)
  INPROCESS_RUNS="c2:2,r4:2 --warmup 2"
  OUTPUT_LEN=4
fi
SERVE_ARGS+=(${SERVE_EXTRA:-})  # e.g. SERVE_EXTRA="--decode-window 4" (also the in-process runs)
export PYTHONUNBUFFERED=1

IMPORTS='import httpx, aiohttp, fastapi, uvicorn, prometheus_client, pydantic, typer'
# the image's typer lacks what rlt_cli needs (TyperOption.display_type): carried wheels win
if [ "${QUICK:-0}" != 1 ] && ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
$PY -c "$IMPORTS" || exit 1
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  $PY -c 'import sys, torch, fastapi, uvicorn, httpx, typer; print("python", sys.version.split()[0],
"torch", torch.__version__, "fastapi", fastapi.__version__, "uvicorn", uvicorn.__version__,
"httpx", httpx.__version__, "typer", typer.__version__)'
  nproc --all
} >"$OUT_DIR/meta.txt" 2>&1

if [ "${SERVE_ONLY:-0}" != 1 ]; then  # SERVE_ONLY=1: the HTTP runs alone (A/B of the server)
$PY -m rlt_cli.main bench --model $MODEL "${OFFLINE_ARGS[@]}" --prompt-len 64 \
  --output-len $OUTPUT_LEN --json >"$OUT_DIR/offline.json"
$PY -c 'import json, sys; r = json.load(open(sys.argv[1]));
[print("offline c", x["concurrency"], round(x["decode_tokens_per_s"], 1), "tok/s, ttft p50",
round(x["ttft_ms_p50"], 1), "ms, tpot p50", round(x["tpot_ms_p50"], 2), "ms") for x in r["results"]]' \
  "$OUT_DIR/offline.json"

# the same serving runs without HTTP (the AsyncEngine in-process): served / in-process is the
# HTTP path's own cost
$PY benchmarks/bench_serving_inprocess.py --model $MODEL "${SERVE_ARGS[@]}" \
  --runs $INPROCESS_RUNS --output-len $OUTPUT_LEN --json >"$OUT_DIR/inprocess.jsonl"
$PY -c 'import json, sys; [print("in-process", r["run"], r["completed"], "ok",
round(r["output_throughput"], 1), "out tok/s, ttft p50", round(r["ttft_ms"]["median"], 1),
"ms, tpot p50", round(r["tpot_ms"]["median"], 2), "ms") for r in map(json.loads, open(sys.argv[1]))]' \
  "$OUT_DIR/inprocess.jsonl"
fi

$PY -m rlt_cli.main serve $MODEL "${SERVE_ARGS[@]}" --port "$PORT" \
  >"$OUT_DIR/server.log" 2>&1 &
SERVER=$!
echo "server pid $SERVER"
$PY - "$URL" "$SERVER" <<'EOF' || { kill "$SERVER"; tail -n 5 "$OUT_DIR/server.log"; exit 1; }
import os, sys, time, httpx
deadline = time.monotonic() + 300
while time.monotonic() < deadline:
    if not os.path.exists(f"/proc/{sys.argv[2]}"):
        sys.exit("the server exited (server.log)")
    try:
        if httpx.get(sys.argv[1] + "/health", timeout=2).status_code == 200:
            print(f"healthy after {time.monotonic() - deadline + 300:.1f} s"); sys.exit(0)
    except httpx.HTTPError:
        pass
    time.sleep(0.5)
sys.exit("server not healthy after 300 s")
EOF

cpu() {  # "label thread utime+stime seconds" for every thread of the server
  local tick; tick=$(getconf CLK_TCK)
  for t in /proc/"$SERVER"/task/*; do
    read -r -a f <"$t/stat" 2>/dev/null || continue
    # fields after the command name: utime is the 14th, stime the 15th of the whole line
    echo "$1 $(basename "$t") $(awk -v u="${f[13]}" -v s="${f[14]}" -v k="$tick" \
      'BEGIN { printf "%.2f", (u + s) / k }')"
  done
}

metrics() {  # the server's /metrics, to stdout
  $PY -c 'import httpx, sys; sys.stdout.write(httpx.get(sys.argv[1] + "/metrics").text)' "$URL"
}

serve_bench() {  # LABEL ARGS...: one `rlt bench --url` run, its JSON labelled, CPU around it
  local label=$1; shift
  cpu "$label-before" >>"$OUT_DIR/cpu.txt"
  metrics >"$OUT_DIR/.metrics-before"
  [ "${QUICK:-0}" = 1 ] && set -- "$@" --num-prompts 2
  local t0; t0=$(date +%s%N)
  $PY -m rlt_cli.main bench --url "$URL" --input-len 64 --output-len $OUTPUT_LEN --json "$@" \
    >"$OUT_DIR/.run.json"
  cpu "$label-after" >>"$OUT_DIR/cpu.txt"
  echo "$label wall_ms $((($(date +%s%N) - t0) / 1000000))" >>"$OUT_DIR/cpu.txt"
  metrics >"$OUT_DIR/.metrics-after"
  # the server's own view of the run (engine-side, from the handler's send to the engine): the
  # means of its histograms over the run, from the /metrics deltas. They include the bench's
  # one uncounted test request. Client minus server = HTTP, SSE and the client.
  $PY - "$label" "$OUT_DIR/.run.json" "$OUT_DIR/.metrics-before" "$OUT_DIR/.metrics-after" \
    >>"$OUT_DIR/serving.jsonl" <<'PYEOF'
import json, sys

def totals(path):
    got = {}
    for line in open(path):
        if line.startswith("#") or " " not in line:
            continue
        name, value = line.rsplit(" ", 1)
        got[name.split("{")[0]] = got.get(name.split("{")[0], 0.0) + float(value)
    return got

label, run, before, after = sys.argv[1:]
r = json.load(open(run))
b, a = totals(before), totals(after)
server = {}
for key, name in (("ttft", "vllm:time_to_first_token_seconds"),
                  ("tpot", "vllm:time_per_output_token_seconds"),
                  ("e2e", "vllm:e2e_request_latency_seconds"),
                  ("step", "rlt:engine_step_seconds")):
    n = a.get(name + "_count", 0) - b.get(name + "_count", 0)
    s = a.get(name + "_sum", 0) - b.get(name + "_sum", 0)
    server[key + "_ms_mean"] = 1e3 * s / n if n else None
    server[key + "_count"] = n
r["run"], r["server"] = label, server
print(json.dumps(r))
PYEOF
  tail -n 1 "$OUT_DIR/serving.jsonl" | $PY -c 'import json, sys; r = json.loads(sys.stdin.read());
s = r["server"]; f = lambda v: "-" if v is None else round(v, 1)
print(r["run"], r["completed"], "ok", r["failed"], "failed", round(r["output_throughput"], 1),
"out tok/s, ttft p50", round(r["ttft_ms"]["median"], 1), "ms, itl p50",
round(r["itl_ms"]["median"], 2), "ms, tpot p50", round(r["tpot_ms"]["median"], 2),
"ms; ttft mean client / server", round(r["ttft_ms"]["mean"], 1), "/", f(s["ttft_ms_mean"]),
"ms, steps", s["step_count"], "of", f(s["step_ms_mean"]), "ms")'
}

# warm-up (not reported as a result): the CUDA-graph batch buckets up to 64 get captured as
# 64 requests ramp up and drain
serve_bench warmup --num-prompts 64 --max-concurrency 64 --seed 99
# and the riding-wave graphs of staggered arrivals (each captured on first use, ~0.2 s)
serve_bench warmup2 --num-prompts 48 --request-rate 16 --seed 98
serve_bench c8 --num-prompts 64 --max-concurrency 8 --seed 8
$PY -c 'import httpx, sys; sys.stdout.write(httpx.get(sys.argv[1] + "/metrics").text)' "$URL" \
  >"$OUT_DIR/metrics_c8.txt"
serve_bench c1 --num-prompts 8 --max-concurrency 1 --seed 1
[ "${SHORT:-0}" = 1 ] || serve_bench c64 --num-prompts 512 --max-concurrency 64 --seed 64
serve_bench rate16 --num-prompts 48 --request-rate 16 --seed 16
if [ "${SHORT:-0}" != 1 ]; then
  serve_bench rate64 --num-prompts 192 --request-rate 64 --seed 65
  serve_bench rate4 --num-prompts 12 --request-rate 4 --seed 4
fi

kill "$SERVER"
wait "$SERVER"
echo "server exited with $?"
rm -f "$OUT_DIR"/.metrics-before "$OUT_DIR"/.metrics-after "$OUT_DIR"/.run.json

