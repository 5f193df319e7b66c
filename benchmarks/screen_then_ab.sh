#!/usr/bin/env bash
# Screen decode-chain variants, then A/B in the engine the ones that shorten the layer, in one
# device call: a screen costs seconds a variant, an A/B minutes, and a device call may be the
# session's only one.
#
#   bash benchmarks/screen_then_ab.sh OUT_DIR VARIANTS_FILE [SCREEN_ARG...]
#
# VARIANTS_FILE: one `--variant=NAME;ITEM[;ITEM...]` a line (screen_chain.py's @FILE form),
# and the `--rows` / `--model` lines it is meant for (benchmarks/variants/*.args); SCREEN_ARG:
# more screen_chain.py arguments, after the file's (a `--rows` here replaces its). Then, best
# first, each variant whose layer the screen found at least GAIN percent shorter (default 0.5)
# runs in ab_decode.py alternated with the tree as it is (base, variant, variant, base), with
# the screen's model and its rows as concurrencies, AB_MAX variants at most (default 3). No
# ab_decode process starts unless DEADLINE_S (default 540) seconds since the start leave room
# for it: AB_FIRST_S (default 180: the engine's start, Triton's compile, the graphs' capture)
# for the first, then the longest after the first (its compiles are on disk by then).
# OUT_DIR: screen/ (the screen's JSON), ab-args/ (base's and the winners' argument files),
# ab.jsonl and ab.md (ab_summary.py's table).
set -uo pipefail
OUT_DIR=${1:?usage: screen_then_ab.sh OUT_DIR VARIANTS_FILE [SCREEN_ARG...]}
VARIANTS=${2:?usage: screen_then_ab.sh OUT_DIR VARIANTS_FILE [SCREEN_ARG...]}
shift 2
PY=${PYTHON:-python3}
GAIN=${GAIN:-0.5} AB_MAX=${AB_MAX:-3} DEADLINE_S=${DEADLINE_S:-540} AB_FIRST_S=${AB_FIRST_S:-180}
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
start=$(date +%s)
mkdir -p "$OUT_DIR"

"$PY" benchmarks/screen_chain.py --out "$OUT_DIR/screen" --ab-args "$OUT_DIR/ab-args" \
  --gain "$GAIN" "@$VARIANTS" "$@" || { echo "screen_then_ab: the screen failed" >&2; exit 1; }

longest=$AB_FIRST_S runs=0
ab() {  # ab @ARGS_FILE: one ab_decode process, if it fits before the deadline
  local left=$((DEADLINE_S - ($(date +%s) - start)))
  if [ "$left" -lt "$longest" ]; then
    echo "screen_then_ab: ${left} s left, an A/B process may take ${longest}: $1 not run" >&2
    return 1
  fi
  local t0=$(date +%s)
  "$PY" benchmarks/ab_decode.py --out "$OUT_DIR" "$@" || return 1
  local took=$(($(date +%s) - t0))
  runs=$((runs + 1))
  # the first run's time stands for the second; from the second on, the longest but the first
  if [ "$runs" -le 2 ] || [ "$took" -gt "$longest" ]; then longest=$took; fi
  return 0
}

n=0
base="@$OUT_DIR/ab-args/base.args"  # the tree as it is: the same model and concurrencies
for args in "$OUT_DIR"/ab-args/[0-9]*.args; do
  [ -e "$args" ] && [ "$n" -lt "$AB_MAX" ] || break
  n=$((n + 1))
  ab "$base" && ab "@$args" && ab "@$args" && ab "$base" || break
done
if [ -s "$OUT_DIR/ab.jsonl" ]; then
  "$PY" benchmarks/ab_summary.py "$OUT_DIR/ab.jsonl" --base base | tee "$OUT_DIR/ab.md"
fi
echo "screen_then_ab: $n variant(s) A/B'd in $(($(date +%s) - start)) s"
