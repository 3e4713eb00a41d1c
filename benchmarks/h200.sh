#!/usr/bin/env bash
# The GPU tables, one device call each: bash benchmarks/h200.sh TABLE [TABLE...]
# Each table's rows and logs go under $OUT/TABLE/ and leave as one archive, $OUT/TABLE.tgz (the
# device tool returns at most 8 files). Tables:
#   moe-kernels   the grouped expert matmul against a dense chain (benchmarks/moe_kernels.py)
#   sanity        the 3.37B shape, the default placement, 6 steps (python -m mtjax.train)
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=$(realpath "${OUT:-benchmarks/results}")
quiet() { grep -v "bfc_allocator\|^W12\|^I12\|^E12"; }

table() {
  local name=$1 dir=$OUT/$1
  mkdir -p "$dir"
  echo "== $(date +%T) $name"
  case $name in
    moe-kernels)
      timeout 420 python3 benchmarks/moe_kernels.py --out "$dir" 2>&1 | quiet | tee "$dir/log" | tail -16 ;;
    sanity)
      timeout 240 python3 -m mtjax.train --config configs/llama_3b.yaml --no-progress --show-plan \
        --json "$dir/summary.json" train.steps=6 2>&1 | quiet | tee "$dir/log" | tail -14 ;;
    *) echo "unknown table $name" ;;
  esac
  (cd "$OUT" && tar -czf "$name.tgz" "$name" && rm -rf "$name")
}

nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
for t in "$@"; do table "$t"; done
