#!/usr/bin/env bash
# Issue 9's 3.37B check, one device call: the run of record's engine and this one side by side on
# the same machine, then DeepSpeed ZeRO-3 offload, then both mtjax rows with the device capped at
# 24 GiB (as on a 24 GB card).
#   git archive 72111a5 mtjax configs | (mkdir -p old_engine && tar -x -C old_engine)
#   bash benchmarks/h200_issue9.sh 8          (carry .whl for DeepSpeed)
# The old engine (commit 72111a5, the record's) runs from old_engine/ when it is there.
set -uo pipefail
BATCH=${1:-8}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=$(realpath "${OUT:-benchmarks/results}")
quiet() { grep -v "bfc_allocator\|^W12\|^I12"; }
ARGS="--config configs/llama_3b.yaml --warmup 1 --steps 3 --systems mtjax train.batch=$BATCH"
VARIANT=(--variant "auto:engine.device_update_layers=auto")
# At batch 32 the record has one row (the host path; the GPU idles under 1%): one variant, two
# steps, so the four runs fit one 600 s call.
[ "$BATCH" -ge 32 ] && { ARGS=${ARGS/--steps 3/--steps 2}; VARIANT=(); }
T=$(( BATCH >= 32 ? 130 : 170 ))
stamp() { echo "== $(date +%T) $*" | tee -a $OUT/issue9_b$BATCH.log; }
stamp "this engine"
timeout $T python3 benchmarks/bench.py $ARGS --no-idle "${VARIANT[@]}" --out $OUT/issue9.json \
  2>&1 | quiet | tee -a $OUT/issue9_b$BATCH.log | tail -6
if [ -d old_engine ]; then
  stamp "the record's engine (72111a5)"
  (cd old_engine && PYTHONPATH=$PWD timeout $T python3 -m mtjax.bench $ARGS "${VARIANT[@]}" \
    --out $OUT/issue9_old.json) 2>&1 | quiet | tee -a $OUT/issue9_b$BATCH.log | tail -6
fi
if ls .whl/deepspeed-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | tail -2
  stamp "deepspeed"
  PYTHONPATH=/tmp/site:$PWD timeout 150 python3 benchmarks/deepspeed_baseline.py \
    --config configs/llama_3b.yaml --warmup 2 --steps 3 --optimizer ds --out $OUT/issue9.json \
    train.batch=$BATCH > $OUT/deepspeed_b$BATCH.log 2>&1
  grep -v "^\[" $OUT/deepspeed_b$BATCH.log | tail -3 | tee -a $OUT/issue9_b$BATCH.log
fi
stamp "this engine, device capped at 24 GiB"
timeout $T python3 benchmarks/bench.py --no-idle "${VARIANT[@]}" --out $OUT/issue9.json \
  $ARGS engine.device_memory_gb=24 2>&1 | quiet | tee -a $OUT/issue9_b$BATCH.log | tail -6
stamp "end"
