#!/usr/bin/env bash
# Session 6's last device call (issue 9: this engine at batch 8, also capped at 24 GiB; issue 11:
# the Llama-3-8B shape at 256k, whole): OUT=DIR bash benchmarks/h200_session6_last.sh
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
quiet() { grep -v "bfc_allocator\|^W12\|^I12"; }
ARGS="--config configs/llama_3b.yaml --warmup 1 --steps 3 --systems mtjax --no-idle"
echo "== $(date +%T) this engine b8"
timeout 130 python3 benchmarks/bench.py $ARGS --variant "auto:engine.device_update_layers=auto" --out $OUT/issue9.json train.batch=8 2>&1 | quiet > $OUT/issue9_new_b8.log; tail -5 $OUT/issue9_new_b8.log
echo "== $(date +%T) this engine b8, 24 GiB"
timeout 120 python3 benchmarks/bench.py $ARGS --variant "auto:engine.device_update_layers=auto" --out $OUT/issue9.json train.batch=8 engine.device_memory_gb=24 2>&1 | quiet > $OUT/issue9_new_b8_24g.log; tail -5 $OUT/issue9_new_b8_24g.log
echo "== $(date +%T) 8B 256k whole"
python3 benchmarks/long_context.py run --out $OUT/context --name 8B --config configs/llama3_8b.yaml --seq 262144 --steps 1 --timeout 300 | tail -1
tail -4 $OUT/context/8B_262144.log
free -g | head -2
echo "== $(date +%T) end"
