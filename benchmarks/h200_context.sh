#!/usr/bin/env bash
# Issue 11's context-length table (README "Long context"), two device calls of under 10 minutes:
#   bash benchmarks/h200_context.sh 8b      Llama-3-8B: 256k whole (one step), 512k and 1M on slices
#   bash benchmarks/h200_context.sh table   3.37B, 8B and 1B rows not yet measured (slices where long)
#   bash benchmarks/h200_context.sh 1m      one 8B layer at 1M tokens, two steps
# Each row is `benchmarks/long_context.py run` (its own processes); the table and the plot are
# rebuilt from every row after each call. The rows are written to a scratch folder and come back as
# one archive, OUT/context.tgz: the device tool returns only so many files from a call (session 7
# lost three rows' files that way).
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
DEST=${OUT:-benchmarks/results}
mkdir -p "$DEST" && DEST=$(realpath "$DEST")
OUT=$(mktemp -d /tmp/context.XXXX)
trap 'tar -czf "$DEST/context.tgz" -C "$OUT" . && echo "rows: $DEST/context.tgz"' EXIT
LC="python3 benchmarks/long_context.py"
LONG="engine.activations=auto engine.activations_every=auto engine.micro_batch=null"
row() { echo "== $(date +%T) $*"; $LC run --out "$OUT" "$@" | tail -1; }
case ${1:-table} in
  8b)
    $LC ceiling --out "$OUT"
    row --name 8B --config configs/llama3_8b.yaml --seq 262144 --steps 1 --timeout 320
    row --name 8B --config configs/llama3_8b.yaml --seq 524288 --layers 2 --timeout 130 --plan-timeout 50
    row --name 8B --config configs/llama3_8b.yaml --seq 1048576 --layers 1 --steps 1 --timeout 110 --plan-timeout 50
    ;;
  table)  # the rows beside 8b's (session 7), in the order that matters most
    $LC ceiling --out "$OUT"
    row --name 3.37B --config configs/llama_3b.yaml --seq 32768 --timeout 60 $LONG
    row --name 3.37B --config configs/llama_3b.yaml --seq 131072 --timeout 150 $LONG
    row --name 3.37B --config configs/llama_3b.yaml --seq 524288 --layers 2 --timeout 110 --plan-timeout 50 $LONG
    row --name 8B --config configs/llama3_8b.yaml --seq 32768 --layers 2 --timeout 50 --plan-timeout 40
    row --name 8B --config configs/llama3_8b.yaml --seq 131072 --layers 2 --timeout 60 --plan-timeout 40
    row --name 1B --config configs/llama_1b.yaml --seq 524288 --layers 2 --timeout 80 --plan-timeout 40 $LONG
    ;;
  1m)  # the stretch: one layer of the 8B shape at 1M tokens (the first step alone took over 110 s)
    $LC ceiling --out "$OUT"
    row --name 8B --config configs/llama3_8b.yaml --seq 1048576 --layers 1 --steps 2 --timeout 420 --plan-timeout 60
    ;;
esac
echo "== $(date +%T) table"
$LC table --out "$OUT" --plot "$OUT/context.png" | tee "$OUT/table.md" | cut -c1-200
