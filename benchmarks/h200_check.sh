#!/usr/bin/env bash
# The standard device check, in one call, in order of importance (a call cut short still answers
# the first questions); the key numbers go to stdout, the files to OUT_DIR.
#
#   bash benchmarks/h200_check.sh [OUT_DIR]            (default: $OUT, else ./h200-check-out)
#   AB=RLT_SLOT_STEP bash benchmarks/h200_check.sh     (also an A/B of one switch: =0 and =1)
#   PROFILE_C="64 256" bash benchmarks/h200_check.sh   (profiles at more concurrencies)
#   TESTS_S=0 / TESTS="tests/kernels" bash benchmarks/h200_check.sh  (no GPU tests / only those)
# Carry the wheels in .whl/ (the run tool's carry=[".whl"]) so the aiohttp tests run too.
#
# 1. the GPU tests, kernels then engines (tests/server has none: the server is tested on the
#    CPU);
# 2. h200_decode.py --only exact (fp32: official code = torch = triton = graphs = CPU);
# 3. rlt bench, Ouro-1.4B dummy bf16, 64/32, depth 4, c = 1/8/64/256 (with AB: once per value);
# 4. the same at 2,000-token prompts, c = 1/2/8 (where attention reads more K/V than weights);
# 5. rlt profile at c=8 and PROFILE_C (kernels per traversal, GPU busy, top kernels).
set -uo pipefail
OUT_DIR=${1:-${OUT:-h200-check-out}}
mkdir -p "$OUT_DIR"
PY=${PYTHON:-python3}
export PYTHONPATH=.:tests
# packages the image lacks (aiohttp for `rlt bench --url` and its tests), carried as wheels in
# .whl/ (run with carry=[".whl"]); without them those tests are left out
if ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
SKIP=()
"$PY" -c "import aiohttp" 2>/dev/null \
  || SKIP=(--ignore=tests/bench/test_serving_stats.py --ignore=tests/cli/test_bench_url.py)
MODEL=tests/fixtures/ouro-1.4b
BENCH=("$PY" -m rlt_cli.main bench --model "$MODEL" --load-format dummy --prompt-len 64
  --output-len 32 -c 1,8,64,256 --json)
start=$(date +%s)
elapsed() { echo "[$(($(date +%s) - start)) s]"; }

summary() {  # one line per bench report: tok/s and TTFT p50 per concurrency, the switches
  "$PY" - "$1" "$2" <<'PYEOF'
import json, sys
d = json.load(open(sys.argv[1]))
runs = " ".join(
    f"c{r['concurrency']}={r['decode_tokens_per_s']:.1f}/ttft{r['ttft_ms_p50']:.1f}"
    for r in d["results"]
)
print(sys.argv[2], runs, d.get("kernels"), flush=True)
PYEOF
}

nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT_DIR/meta.txt"
# the GPU tests in two runs (benchmarks/README): the kernel tests on 8 workers, then the engine
# tests in one process, alone on the GPU (each engine sizes its KV cache from the free memory);
# ~5 minutes on an H100. TESTS_S=0 leaves them out, TESTS="tests/kernels ..." runs only those
# paths (in one process); TESTS_S bounds each run
gpu_tests() {  # NAME, then pytest's arguments
  local name=$1
  shift
  timeout "${TESTS_S:-360}" "$PY" -m pytest -q -m gpu -p no:cacheprovider "$@" \
    > "$OUT_DIR/gpu-tests-$name.txt" 2>&1
  [ $? = 124 ] && echo "gpu tests ($name): cut at ${TESTS_S:-360} s, unfinished"
  echo "gpu tests ($name): $(tail -1 "$OUT_DIR/gpu-tests-$name.txt") $(elapsed)"
  grep -E "^FAILED" "$OUT_DIR/gpu-tests-$name.txt" | head -10
}
if [ "${TESTS_S:-360}" != 0 ]; then
  if [ -n "${TESTS:-}" ]; then
    gpu_tests chosen -n 0 --ignore=tests/server "${SKIP[@]}" $TESTS
  else
    gpu_tests kernels -n 8 tests/kernels
    gpu_tests engines -n 0 --ignore=tests/kernels --ignore=tests/server "${SKIP[@]}" tests
  fi
fi
timeout 200 "$PY" benchmarks/h200_decode.py --only exact --out "$OUT_DIR" > "$OUT_DIR/exact.log" 2>&1
echo "exact: rc=$? $(grep -o '"all_exact": [a-z]*' "$OUT_DIR/exact.log") $(elapsed)"
for value in ${AB:+0 1} default; do
  [ "$value" = default ] && [ -n "${AB:-}" ] && break
  name=bench${AB:+-$AB-$value}
  env ${AB:+$AB=$value} timeout 200 "${BENCH[@]}" > "$OUT_DIR/$name.json" 2> "$OUT_DIR/$name.err" \
    && summary "$OUT_DIR/$name.json" "$name" || tail -3 "$OUT_DIR/$name.err"
  elapsed
done
timeout 200 "$PY" -m rlt_cli.main bench --model "$MODEL" --load-format dummy --prompt-len 2000 \
  --output-len 32 -c 1,2,8 --json > "$OUT_DIR/bench-long.json" 2> "$OUT_DIR/bench-long.err" \
  && summary "$OUT_DIR/bench-long.json" bench-long || tail -3 "$OUT_DIR/bench-long.err"
elapsed
for c in 8 ${PROFILE_C:-}; do  # PROFILE_C="64 256": profiles at more concurrencies
  timeout 150 "$PY" -m rlt_cli.main profile --model "$MODEL" --load-format dummy \
    --prompt-len 64 --output-len 32 -c "$c" --top 40 --trace-out "/tmp/check-c$c.json" --json \
    > "$OUT_DIR/profile-c$c.json" 2> "$OUT_DIR/profile-c$c.err"
  "$PY" - "$OUT_DIR/profile-c$c.json" "$c" <<'PYEOF' || tail -3 "$OUT_DIR/profile-c$c.err"
import json, sys
d = json.load(open(sys.argv[1]))
g = d["gpu"]
top = ", ".join(f"{k['name'][:40]} {k['share']:.0%}" for k in d["top"]["items"][:4])
print(f"profile c{sys.argv[2]}:", round(d["decode_tokens_per_s"], 1), "tok/s,",
      round(g["kernels_per_traversal"], 1), "kernels/traversal, GPU busy",
      round(g["busy_share_decode_window"], 3), "of decode windows /",
      round(g["busy_share_decode_steps"], 3), "of decode steps; top:", top)
PYEOF
  elapsed
done
