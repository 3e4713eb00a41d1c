#!/usr/bin/env bash
# Issue 4's run on the lent H200 machine: plan, then train the largest shape that fits (9.17B).
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/results}
quiet() { grep -v "bfc_allocator\|^W1202"; }
python3 -m mtjax.plan --config configs/llama_9b.yaml | tee $OUT/llama_9b.log
( while sleep 5; do echo "$(date +%T) $(free -g | awk '/Mem/{print "used " $3 " GiB, avail " $7}')"; done ) > $OUT/llama_9b_mem.log &
timeout 520 python3 -m mtjax.train --config configs/llama_9b.yaml --no-progress --json $OUT/llama_9b.json \
  train.steps=4 2>&1 | quiet | tee -a $OUT/llama_9b.log
