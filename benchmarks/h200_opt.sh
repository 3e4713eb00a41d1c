#!/usr/bin/env bash
# Issue 3, third pass (one device call): where does the host optimizer's time go inside a step?
# Batch 8 on the 3.37B shape: thread counts and dynamic chunks of the host AdamW, with and without
# device-side updates of the backward's tail; per-thread CPU time of every timed step.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/results}
mkdir -p /tmp/tl
nproc; cat /proc/loadavg
timeout 540 python3 -m mtjax.bench --config configs/llama_3b.yaml --warmup 1 --steps 3 \
  --systems mtjax,roofline --out $OUT/h200_b8.json --timeline /tmp/tl/b8.png \
  --variant "t12:optim.threads=12" --variant "t14:optim.threads=14" \
  --variant "chunk:optim.chunk=1048576" --variant "t12chunk:optim.threads=12 optim.chunk=1048576" \
  --variant "dev10t12:engine.device_update_layers=10 optim.threads=12" \
  --variant "dev14t12:engine.device_update_layers=14 optim.threads=12" \
  2>&1 | grep -v "bfc_allocator\|^W1202" | tee $OUT/h200_b8.log
tar cf $OUT/timelines_b8.tar -C /tmp/tl .
