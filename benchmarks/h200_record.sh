#!/usr/bin/env bash
# Issue 3's run of record, one device call per batch size: the 3.37B shape, every mtjax system side
# by side in one process, then DeepSpeed ZeRO-3 CPU offload on the same shape on the same machine.
#   bash benchmarks/h200_record.sh 8    (then: bash benchmarks/h200_record.sh 32)
# DeepSpeed needs the wheels of benchmarks/deepspeed_wheels.sh in .whl/ (carry it); without them
# its row is skipped. DeepSpeed's own CPU Adam is tried first, torch's fused AdamW if it cannot build.
set -uo pipefail
BATCH=${1:-8}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/results}
mkdir -p /tmp/tl
LOG=$OUT/h200_b$BATCH.log
quiet() { grep -v "bfc_allocator\|^W1202"; }
SYSTEMS=mtjax,mtjax-serial,jax-all-gpu,roofline
[ "$BATCH" -gt 8 ] && SYSTEMS=mtjax,jax-all-gpu,roofline  # serial at batch 32 adds minutes, no news
timeout 270 python3 benchmarks/bench.py --config configs/llama_3b.yaml --warmup 1 --steps 3 \
  --systems $SYSTEMS --out $OUT/h200.json --timeline /tmp/tl/b$BATCH.png \
  --variant "auto:engine.device_update_layers=auto" train.batch=$BATCH 2>&1 | quiet | tee $LOG
tar cf $OUT/timelines_b$BATCH.tar -C /tmp/tl b$BATCH.png b${BATCH}_auto.png
if ls .whl/deepspeed-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | tail -2
  for opt in ds torch; do
    echo "== deepspeed, optimizer $opt" | tee -a $LOG
    PYTHONPATH=/tmp/site:$PWD timeout 300 python3 benchmarks/deepspeed_baseline.py \
      --config configs/llama_3b.yaml --warmup 2 --steps 4 --optimizer $opt --out $OUT/h200.json \
      train.batch=$BATCH > $OUT/deepspeed_b${BATCH}_$opt.log 2>&1
    rc=$?
    grep -v "^\[" $OUT/deepspeed_b${BATCH}_$opt.log | tail -25 | tee -a $LOG
    [ $rc -eq 0 ] && break
  done
fi
