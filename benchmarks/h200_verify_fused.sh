#!/usr/bin/env bash
# One device call that verifies and measures what the 2026-12-01 session could only check on the
# CPU: PDL at the engine level, and the fused row bookkeeping (kernels/slot_step.py + the gated
# greedy argmax, off on CUDA unless RLT_SLOT_STEP=1). In order of importance, so a call cut
# short still answers the first questions; the key numbers go to stdout.
#
#   bash benchmarks/h200_verify_fused.sh [OUT_DIR]      (default: $OUT, else ./h200-fused-out)
#
# 1. the GPU tests (the server's need the openai package, which the device image lacks), once
#    with the fused rows off (the default) and once on;
# 2. h200_decode.py --only exact with the fused rows on (fp32: torch = triton = graphs = CPU);
# 3. rlt bench, Ouro-1.4B dummy bf16, 64/32, depth 4, c = 1/8/64/256: fused rows off, then on;
# 4. rlt profile at c=8 with the fused rows on (kernels per traversal, GPU busy).
# If 1-3 pass and 3 gains, flip the default in kernels/slot_step.enabled and record the JSONs.
set -uo pipefail
OUT_DIR=${1:-${OUT:-h200-fused-out}}
mkdir -p "$OUT_DIR"
PY=${PYTHON:-python3}
export PYTHONPATH=.:tests
MODEL=tests/fixtures/ouro-1.4b
BENCH=("$PY" -m rlt_cli.main bench --model "$MODEL" --load-format dummy --prompt-len 64
  --output-len 32 -c 1,8,64,256 --json)
start=$(date +%s)
elapsed() { echo "[$(($(date +%s) - start)) s]"; }

summary() {  # one line per bench report: tok/s and TTFT p50 per concurrency, the switches
  "$PY" - "$1" "$2" <<'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
runs = " ".join(
    f"c{r['concurrency']}={r['decode_tokens_per_s']:.1f}/ttft{r['ttft_ms_p50']:.1f}"
    for r in d["results"]
)
print(sys.argv[2], runs, d.get("kernels"), flush=True)
EOF
}

nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT_DIR/meta.txt"
for mode in 0 1; do
  RLT_SLOT_STEP=$mode timeout 400 "$PY" -m pytest -q -x -m gpu --ignore=tests/server \
    -p no:cacheprovider > "$OUT_DIR/gpu-tests-slot-step-$mode.txt" 2>&1
  echo "gpu tests RLT_SLOT_STEP=$mode: $(tail -1 "$OUT_DIR/gpu-tests-slot-step-$mode.txt") $(elapsed)"
done
RLT_SLOT_STEP=1 timeout 300 "$PY" benchmarks/h200_decode.py --only exact --out "$OUT_DIR" \
  > "$OUT_DIR/exact.log" 2>&1
echo "exact (fused rows on): rc=$? $(tail -2 "$OUT_DIR/exact.log" | tr '\n' ' ') $(elapsed)"
for mode in 0 1; do
  RLT_SLOT_STEP=$mode timeout 200 "${BENCH[@]}" > "$OUT_DIR/bench-slot-step-$mode.json" \
    2> "$OUT_DIR/bench-slot-step-$mode.err" \
    && summary "$OUT_DIR/bench-slot-step-$mode.json" "bench RLT_SLOT_STEP=$mode" \
    || tail -3 "$OUT_DIR/bench-slot-step-$mode.err"
  elapsed
done
RLT_SLOT_STEP=1 timeout 150 "$PY" -m rlt_cli.main profile --model "$MODEL" --load-format dummy \
  --prompt-len 64 --output-len 32 -c 8 --top 40 --trace-out /tmp/fused-c8.json --json \
  > "$OUT_DIR/profile-c8-slot-step-1.json" 2> "$OUT_DIR/profile.err"
"$PY" - "$OUT_DIR/profile-c8-slot-step-1.json" <<'EOF' || tail -3 "$OUT_DIR/profile.err"
import json, sys
d = json.load(open(sys.argv[1]))
g = d["gpu"]
print("profile c8 (fused rows):", round(d["decode_tokens_per_s"], 1), "tok/s,",
      round(g["kernels_per_traversal"], 1), "kernels/traversal, GPU busy",
      round(g["busy_share_decode_window"], 3), "of decode windows")
EOF
elapsed
