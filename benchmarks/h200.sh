#!/usr/bin/env bash
# The run of record on the lent H200 machine (one device call): correctness first, then timings.
set -euo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/results}
python3 benchmarks/attention_check.py
python3 benchmarks/host_adamw.py
python3 -m mtjax.bench --config configs/llama_3b.yaml --steps 4 --out $OUT/h200.json \
  --timeline $OUT/h200_3b_b8_timeline.png \
  --variant "dev8:engine.device_update_layers=8" --variant "dev14:engine.device_update_layers=14"
python3 -m mtjax.bench --config configs/llama_3b.yaml --steps 3 --systems mtjax,jax-all-gpu,roofline \
  --out $OUT/h200.json --timeline $OUT/h200_3b_b32_timeline.png train.batch=32 \
  --variant "dev6:engine.device_update_layers=6"
