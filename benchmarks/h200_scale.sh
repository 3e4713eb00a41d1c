#!/usr/bin/env bash
# Issue 4's runs on the lent H200 machine: plan, then train 7B and the largest shape that fits.
set -euo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/results}
for shape in llama_7b llama_9b; do
  python3 -m mtjax.plan --config configs/$shape.yaml
  python3 -m mtjax.train --config configs/$shape.yaml --no-progress --json $OUT/$shape.json train.steps=4
done
