#!/usr/bin/env bash
# Issue 3's run of record (one device call): the 3.37B shape at batch 8 and 32,
# every system side by side, with the planner's choice of device-side updates (auto) and all of them.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/results}
mkdir -p /tmp/tl
quiet() { grep -v "bfc_allocator\|^W1202"; }
timeout 240 python3 -m mtjax.bench --config configs/llama_3b.yaml --warmup 1 --steps 3 \
  --systems mtjax,mtjax-serial,jax-all-gpu,roofline --out $OUT/h200.json --timeline /tmp/tl/b8.png \
  --variant "auto:engine.device_update_layers=auto" --variant "all:engine.device_update_layers=30" \
  2>&1 | quiet | tee $OUT/h200.log
timeout 270 python3 -m mtjax.bench --config configs/llama_3b.yaml --warmup 1 --steps 3 \
  --systems mtjax,jax-all-gpu,roofline --out $OUT/h200.json --timeline /tmp/tl/b32.png \
  --variant "auto:engine.device_update_layers=auto" --variant "all:engine.device_update_layers=30" \
  train.batch=32 2>&1 | quiet | tee -a $OUT/h200.log
tar cf $OUT/timelines.tar -C /tmp/tl .
