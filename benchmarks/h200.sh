#!/usr/bin/env bash
# The GPU tables, each sized for one device call of under 10 minutes:
#   bash benchmarks/h200.sh [--dry-run] TABLE [TABLE...]
# Each table's rows and logs go under $OUT/TABLE/ (default benchmarks/results/h200/) and leave as
# one archive, $OUT/TABLE.tgz (a device call returns only a few files). --dry-run prints the
# commands instead of running them. Tables (docs/performance.md and docs/long_context.md hold
# their latest figures):
#   gpu-check    the engine against the reference on the GPU in every placement; host update rates
#   sanity       the 3.37B shape, the default placement, 6 steps (python -m mtjax.train)
#   placement    default configs: 3.37B and 8B at 8 x 2048
#   bench-b8     3.37B at 8 x 2048 side by side: mtjax (default, host AdamW, 24 GiB of device
#                memory), the serial engine, all-on-GPU JAX, the roofline; then DeepSpeed ZeRO-3
#                offload (carry .whl from benchmarks/deepspeed_wheels.sh)
#   bench-b32    the same at batch 32 (no serial row)
#   families     default configs: DeepSeek-V2-Lite, Gemma 2 9B, GPT-OSS-20B (bf16 moments)
#   recipes      the 1B Llama-3.2 shape: SFT from a ShareGPT file, DPO from its export on preference
#                rows (100 steps each), batch 32 in one pass and in 4 (benchmarks/recipes.py)
#   defaults     default configs, plan beside measured, plain JAX beside them where it fits: the
#                Llama-3.2-1B shape at 8 x 1024 and 3.37B at 8 x 2048 (bench.py: mtjax and
#                jax-all-gpu in one process), 3.37B at 32 x 2048
#   defaults-large  default configs, plan beside measured: 8B at 8 x 2048 and 1 x 32768, the
#                Qwen2.5-14B shape at 8 x 2048 (host RAM and GPU memory together: the H200 only)
#   largest      the largest shape the planner fits: the Qwen2.5-14B width with 50 layers
#   30b-moe      Qwen3-30B-A3B's shape at 8-bit moments, default placement (the H200 only)
#   32b          Qwen2.5-32B's shape at 8-bit moments, default placement (the H200 only)
#   qwen3-moe    a Qwen3-MoE of Qwen3-30B-A3B width, 4 layers, default placement; then DeepSpeed
#                ZeRO-3 offload on transformers' Qwen3-MoE of the same shape (carry .whl)
#   moe-kernels  the grouped expert matmul against a dense chain (benchmarks/moe_kernels.py)
#   attention    each attention kernel per layer variant: packed documents, head width 256,
#                soft-capped logits, windows (benchmarks/attention_kernels.py)
#   finetune     a 1B Hugging Face Llama fine-tuned 200 steps, exported, checked (finetune.py)
#   context      long context: 3.37B at 32k and 128k whole, 512k on a slice; 8B at 32k and 128k
#                on slices; 1B at 512k on a slice
#   context-8b   long context: the 8B shape at 256k whole, 512k and 1M on slices
#   context-1m   one layer of the 8B shape at 1M tokens, two steps
set -uo pipefail
DRY=
[ "${1:-}" = "--dry-run" ] && { DRY=1; shift; }
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
# Wheels carried in .whl/ (packages the GPU image lacks: tensorboardX, google-crc32c; DeepSpeed's
# from benchmarks/deepspeed_wheels.sh) install into /tmp/site, ahead of the image's packages.
if [ -z "$DRY" ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
OUT=$(realpath -m "${OUT:-benchmarks/results/h200}")
TABLES="gpu-check sanity placement bench-b8 bench-b32 families recipes defaults defaults-large largest 30b-moe 32b qwen3-moe moe-kernels
attention finetune context context-8b context-1m"
quiet() { grep -v "bfc_allocator\|^W12\|^I12\|^E12"; }

x() {  # x LOG TIMEOUT COMMAND...: runs COMMAND (output to LOG), or prints it under --dry-run
  local log=$1 t=$2
  shift 2
  if [ -n "$DRY" ]; then printf "+"; printf " %q" "$@"; echo; return 0; fi
  echo "-- $(date +%T) $*"
  timeout "$t" "$@" 2>&1 | quiet > "$log"
  tail -8 "$log"
}

train() {  # train DIR NAME TIMEOUT ARGS...: python -m mtjax.train, its summary as DIR/NAME.json
  local dir=$1 name=$2 t=$3
  shift 3
  x "$dir/$name.log" "$t" python3 -m mtjax.train --no-progress --show-plan --json "$dir/$name.json" "$@"
}

bench() {  # bench DIR BATCH TIMEOUT SYSTEMS STEPS: the 3.37B shape side by side, then DeepSpeed
  local dir=$1 b=$2 t=$3 systems=$4 steps=$5
  x "$dir/bench_b$b.log" "$t" python3 benchmarks/bench.py --config configs/llama_3b.yaml \
    --warmup 1 --steps "$steps" --systems "$systems" --out "$dir/bench.json" \
    --timeline "$dir/b$b.png" --variant "host:engine.device_state_layers=0 engine.device_update_layers=0" \
    --variant "24gib:engine.device_memory_gb=24" train.batch="$b"
  if ls .whl/deepspeed-*.whl >/dev/null 2>&1 || [ -n "$DRY" ]; then  # installed above
    x "$dir/deepspeed_b$b.log" 200 python3 benchmarks/deepspeed_baseline.py \
      --config configs/llama_3b.yaml --warmup 2 --steps 3 --optimizer ds --out "$dir/bench.json" \
      train.batch="$b"
  fi
}

row() {  # row DIR ARGS...: one long-context row (benchmarks/long_context.py run)
  local dir=$1
  shift
  x "$dir/rows.log" 600 python3 benchmarks/long_context.py run --out "$dir" "$@"
}

LONG="engine.activations=auto engine.activations_every=auto engine.micro_batch=null"

table() {
  local name=$1 dir=$OUT/$1
  [ -z "$DRY" ] && mkdir -p "$dir"
  echo "== $(date +%T) $name"
  case $name in
    gpu-check)
      x "$dir/log" 150 python3 benchmarks/gpu_check.py ;;
    sanity)
      train "$dir" summary 240 --config configs/llama_3b.yaml train.steps=6 ;;
    placement)
      train "$dir" 3b_b8 110 --config configs/llama_3b.yaml train.steps=6
      train "$dir" 8b_b8 170 --config configs/llama3_8b.yaml train.batch=8 train.seq=2048 train.steps=5 ;;
    bench-b8)
      bench "$dir" 8 330 mtjax,mtjax-serial,jax-all-gpu,roofline 3 ;;
    bench-b32)
      bench "$dir" 32 330 mtjax,jax-all-gpu,roofline 2 ;;
    families)
      train "$dir" deepseek_v2_lite 170 --config configs/deepseek_v2_lite.yaml train.steps=5
      train "$dir" gemma2_9b 150 --config configs/gemma2_9b.yaml train.steps=5
      train "$dir" gpt_oss_20b 240 --config configs/gpt_oss_20b.yaml train.steps=5 ;;
    recipes)
      x "$dir/log" 560 python3 benchmarks/recipes.py "$dir" --steps 100 ;;
    defaults)
      x "$dir/bench_1b.log" 150 python3 benchmarks/bench.py --config configs/llama3.2_1b.yaml \
        --systems mtjax,jax-all-gpu --no-idle --steps 5 --out "$dir/bench_1b.json"
      x "$dir/bench_3b.log" 200 python3 benchmarks/bench.py --config configs/llama_3b.yaml \
        --systems mtjax,jax-all-gpu --no-idle --warmup 1 --steps 4 --out "$dir/bench_3b.json"
      train "$dir" 3b_b32 130 --config configs/llama_3b.yaml train.batch=32 train.steps=4 ;;
    defaults-large)
      train "$dir" 8b_b8 130 --config configs/llama3_8b.yaml train.batch=8 train.seq=2048 train.steps=5
      train "$dir" 8b_32k 140 --config configs/llama3_8b.yaml train.seq=32768 train.steps=4
      train "$dir" qwen14b 230 --config configs/qwen2.5_14b.yaml train.steps=5 ;;
    largest)
      train "$dir" qwen14b_50_layers 300 --config configs/qwen2.5_14b.yaml model.layers=50 train.steps=4 ;;
    30b-moe)
      train "$dir" qwen3_30b_a3b 560 --config configs/qwen3_30b_a3b.yaml train.steps=4 train.tensorboard=false ;;
    32b)
      train "$dir" qwen2.5_32b 560 --config configs/qwen2.5_32b.yaml train.steps=4 train.tensorboard=false ;;
    qwen3-moe)
      train "$dir" qwen3_moe 130 --config configs/qwen3_moe_4l.yaml train.steps=6
      if ls .whl/deepspeed-*.whl >/dev/null 2>&1 || [ -n "$DRY" ]; then
        x "$dir/deepspeed.log" 400 python3 benchmarks/deepspeed_baseline.py \
          --config configs/qwen3_moe_4l.yaml --warmup 1 --steps 2 --optimizer ds --out "$dir/deepspeed.json"
      fi ;;
    moe-kernels)
      x "$dir/log" 200 python3 benchmarks/moe_kernels.py --out "$dir" --shapes qwen3-30b-a3b,gpt-oss-20b ;;
    attention)
      x "$dir/log" 300 python3 benchmarks/attention_kernels.py --out "$dir/attention.json" ;;
    finetune)
      x "$dir/log" 560 python3 benchmarks/finetune.py "$dir" --steps 200 ;;
    context)
      x "$dir/ceiling.log" 60 python3 benchmarks/long_context.py ceiling --out "$dir"
      row "$dir" --name 3.37B --config configs/llama_3b.yaml --seq 32768 --timeout 60 $LONG
      row "$dir" --name 3.37B --config configs/llama_3b.yaml --seq 131072 --timeout 150 $LONG
      row "$dir" --name 3.37B --config configs/llama_3b.yaml --seq 524288 --layers 2 --timeout 110 --plan-timeout 50 $LONG
      row "$dir" --name 8B --config configs/llama3_8b.yaml --seq 32768 --layers 2 --timeout 50 --plan-timeout 40
      row "$dir" --name 8B --config configs/llama3_8b.yaml --seq 131072 --layers 2 --timeout 60 --plan-timeout 40
      row "$dir" --name 1B --config configs/llama_1b.yaml --seq 524288 --layers 2 --timeout 80 --plan-timeout 40 $LONG ;;
    context-8b)
      x "$dir/ceiling.log" 60 python3 benchmarks/long_context.py ceiling --out "$dir"
      row "$dir" --name 8B --config configs/llama3_8b.yaml --seq 262144 --steps 1 --timeout 320
      row "$dir" --name 8B --config configs/llama3_8b.yaml --seq 524288 --layers 2 --timeout 130 --plan-timeout 50
      row "$dir" --name 8B --config configs/llama3_8b.yaml --seq 1048576 --layers 1 --steps 1 --timeout 110 --plan-timeout 50 ;;
    context-1m)
      x "$dir/ceiling.log" 60 python3 benchmarks/long_context.py ceiling --out "$dir"
      row "$dir" --name 8B --config configs/llama3_8b.yaml --seq 1048576 --layers 1 --steps 2 --timeout 420 --plan-timeout 60 ;;
    *) echo "unknown table $name; tables: $TABLES" >&2; return 2 ;;
  esac
  case $name in context*)
    x "$dir/table.md" 60 python3 benchmarks/long_context.py table --out "$dir" --plot "$dir/context.png" ;;
  esac
  [ -z "$DRY" ] && (cd "$OUT" && tar -czf "$name.tgz" "$name" && rm -rf "$name")
  return 0
}

[ $# -gt 0 ] || { echo "usage: bash benchmarks/h200.sh [--dry-run] TABLE...; tables: $TABLES" >&2; exit 2; }
if [ -z "$DRY" ]; then
  nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
  python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
fi
rc=0
for t in "$@"; do table "$t" || rc=2; done
exit $rc
