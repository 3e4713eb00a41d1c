#!/usr/bin/env bash
# Issue 9 on the lent H200, one device call: the engine's correctness on the GPU in every tier mix,
# then the Qwen2.5-14B shape at full precision (state in host RAM and device memory), then the
# largest shape the planner fits.   bash benchmarks/h200_store.sh [LARGEST_LAYERS]
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/results/store}
mkdir -p $OUT
quiet() { grep -v "bfc_allocator\|^W120\|^I120\|^E0000"; }
timeout 120 python3 benchmarks/gpu_check.py 2>&1 | quiet | tee $OUT/gpu_check.log
memlog() { while sleep 2; do echo "$(date +%T) $(free -m | awk '/Mem/{print "used " $3 " MiB, avail " $7}') $(nvidia-smi --query-gpu=memory.used --format=csv,noheader)"; done; }
run() {  # name, timeout, overrides...
  local name=$1 limit=$2; shift 2
  memlog > $OUT/${name}_mem.log & local pid=$!
  timeout $limit python3 -m mtjax.train --config configs/qwen2.5_14b.yaml --no-progress --show-plan \
    --json $OUT/$name.json "$@" 2>&1 | quiet | tee $OUT/$name.log
  kill $pid
}
run qwen14b 300 train.steps=6
run largest 280 model.layers=${1:-56} train.steps=4
