#!/usr/bin/env bash
# The GPU tables, one device call each: bash benchmarks/h200.sh TABLE [TABLE...]
# Each table's rows and logs go under $OUT/TABLE/ and leave as one archive, $OUT/TABLE.tgz (the
# device tool returns at most 8 files). Tables:
#   moe-kernels   the grouped expert matmul against a dense chain (benchmarks/moe_kernels.py)
#   sanity        the 3.37B shape, the default placement, 6 steps (python -m mtjax.train)
#   qwen3-moe     a Qwen3-MoE of Qwen3-30B-A3B width, 4 layers, default placement
#   placement     default configs: 3.37B and 8B at 8 x 2048
#   families      default configs: DeepSeek-V2-Lite, Gemma 2 9B, the Qwen2.5-14B shape
#   defaults      default configs beside plain JAX: the Llama-3.2-1B shape at 8 x 1024 (bench.py,
#                 mtjax and jax-all-gpu side by side), the Qwen2.5-14B shape at 8 x 2048, 8B at 1 x 32768
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=$(realpath "${OUT:-benchmarks/results}")
quiet() { grep -v "bfc_allocator\|^W12\|^I12\|^E12"; }

run() {  # run DIR NAME TIMEOUT ARGS...: python -m mtjax.train, its summary as DIR/NAME.json
  local dir=$1 name=$2 t=$3
  shift 3
  echo "-- $name: $*"
  timeout "$t" python3 -m mtjax.train --no-progress --show-plan --json "$dir/$name.json" "$@" \
    2>&1 | quiet > "$dir/$name.log"
  grep -E "layer groups|predicted step [0-9]|runner-up|^model|^loss|^speed|^memory|refused|error" \
    "$dir/$name.log" | head -12
}

table() {
  local name=$1 dir=$OUT/$1
  mkdir -p "$dir"
  echo "== $(date +%T) $name"
  case $name in
    moe-kernels)
      timeout 200 python3 benchmarks/moe_kernels.py --out "$dir" --shapes qwen3-30b-a3b,gpt-oss-20b \
        2>&1 | quiet | tee "$dir/log" | tail -8 ;;
    qwen3-moe)
      run "$dir" qwen3_moe 130 --config configs/qwen3_moe_4l.yaml train.steps=6 ;;
    placement)
      run "$dir" 3b_b8 110 --config configs/llama_3b.yaml train.steps=6
      run "$dir" 8b_b8 170 --config configs/llama3_8b.yaml train.batch=8 train.seq=2048 train.steps=5 ;;
    families)
      run "$dir" deepseek_v2_lite 190 --config configs/deepseek_v2_lite.yaml train.steps=5
      run "$dir" gemma2_9b 170 --config configs/gemma2_9b.yaml train.steps=5
      run "$dir" qwen14b 200 --config configs/qwen2.5_14b.yaml train.steps=5 ;;
    defaults)
      echo "-- bench_1b"
      timeout 170 python3 benchmarks/bench.py --config configs/llama3.2_1b.yaml --systems mtjax,jax-all-gpu \
        --no-idle --steps 5 --out "$dir/bench_1b.json" 2>&1 | quiet | tee "$dir/bench_1b.log" | tail -6
      run "$dir" qwen14b 190 --config configs/qwen2.5_14b.yaml train.steps=5
      run "$dir" 8b_32k 170 --config configs/llama3_8b.yaml train.seq=32768 train.steps=4 ;;
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
