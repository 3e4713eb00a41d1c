"""How fast is DeepSpeed ZeRO-3 with CPU offload on an mtjax config's shape? The bench table's
baseline.

The same model through transformers (`AutoModelForCausalLM` from the config.json the family writes
on export: Llama, Qwen3-MoE, any family): fp32 parameters and AdamW state offloaded to (pinned) host
memory, bf16 compute, activation checkpointing on, DeepSpeed's CPU Adam. Model TFLOP/s count active
parameters (a mixture's chosen experts), as mtjax's records do.
Appends one record in benchmarks/bench.py's format (system `deepspeed-zero3-offload`) to --out.

Needs torch, transformers and deepspeed (an optional extra, never a dependency of mtjax). DeepSpeed
ships a source archive only: build a pure-Python wheel once with `bash benchmarks/deepspeed_wheels.sh`
(DS_BUILD_OPS=0; its CPU Adam is compiled on the GPU machine at first use) and carry `.whl`:

  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
  PYTHONPATH=/tmp/site:$PWD python3 benchmarks/deepspeed_baseline.py --config configs/llama_3b.yaml \\
      --out benchmarks/results/h200.json [train.batch=32]

--optimizer torch swaps DeepSpeed's compiled CPU Adam for torch's fused CPU AdamW (same ZeRO-3
offload otherwise), for an image where the CPU Adam extension cannot be built.

--system torch-all-gpu runs the same transformers model as plain PyTorch all on the GPU (no
DeepSpeed): fp32 parameters and torch's fused AdamW in device memory, bf16 autocast, activation
checkpointing only with --checkpointing; transformers' own kernels (sdpa attention, its grouped
expert matmul where the family has one). The anchor mtjax's all-GPU-sized rows stand beside.

--smoke builds configs/tiny.yaml's shape (and with --config another, e.g. a tiny mixture) in
transformers on the CPU and takes two plain torch AdamW steps without DeepSpeed (which needs a GPU):
the shape translation and the record, in seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # run as a script: the repository root holds mtjax
  sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mtjax import cli, config as config_lib, data, plan


def ds_config(cfg: config_lib.Config) -> dict:
  o, t = cfg.optim, cfg.train
  return {
      "train_micro_batch_size_per_gpu": t.batch,
      "gradient_accumulation_steps": 1,
      "bf16": {"enabled": cfg.engine.compute_dtype == "bfloat16"},
      "zero_optimization": {
          "stage": 3,
          "offload_param": {"device": "cpu", "pin_memory": True},
          "offload_optimizer": {"device": "cpu", "pin_memory": True},
          "overlap_comm": True,
          "contiguous_gradients": True,
      },
      "optimizer": {"type": "AdamW", "params": {"lr": o.lr, "betas": [o.b1, o.b2], "eps": o.eps,
                                                "weight_decay": o.weight_decay}},
      "gradient_clipping": o.clip_norm or 0.0,
      "wall_clock_breakdown": False,
  }


def hf_model(m: config_lib.ModelConfig, seq: int):
  """transformers' model of this shape, built from the config.json mtjax's family writes."""
  from transformers import AutoConfig, AutoModelForCausalLM
  from mtjax import models
  conf = dict(models.get(m.family).write_config(m, "float32"))
  conf.update(use_cache=False, max_position_embeddings=max(seq, conf.get("max_position_embeddings") or 0))
  conf = AutoConfig.for_model(conf.pop("model_type"), **conf)
  return AutoModelForCausalLM.from_config(conf, attn_implementation="sdpa")


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--warmup", type=int, default=2)
  p.add_argument("--steps", type=int, default=4)
  p.add_argument("--out", help="append the record to this JSON list")
  p.add_argument("--optimizer", choices=("ds", "torch"), default="ds",
                 help="ds: DeepSpeedCPUAdam (compiled at first use); torch: torch.optim.AdamW(fused)")
  p.add_argument("--system", choices=("deepspeed", "torch-all-gpu"), default="deepspeed",
                 help="deepspeed: ZeRO-3 with CPU offload; torch-all-gpu: plain PyTorch on the GPU")
  p.add_argument("--checkpointing", action="store_true",
                 help="torch-all-gpu: activation checkpointing (DeepSpeed's runs always use it)")
  p.add_argument("--smoke", action="store_true",
                 help="tiny shape, CPU, torch AdamW without DeepSpeed, in seconds")
  argv = sys.argv[1:] if argv is None else list(argv)
  if "--smoke" in argv:
    tiny = str(Path(__file__).resolve().parent.parent / "configs" / "tiny.yaml")
    argv = ([] if "--config" in argv else ["--config", tiny]) + [
        "--warmup", "1", "--steps", "1", *argv, "engine.compute_dtype=float32"]
  args, cfg = cli.parse_cli(p, argv)
  if args.smoke:
    return smoke(args, cfg)
  if args.system == "torch-all-gpu":
    return all_gpu(args, cfg)
  for k, v in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29517"), ("RANK", "0"),
               ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
    os.environ.setdefault(k, v)
  import deepspeed
  import torch

  m, t = cfg.model, cfg.train
  if cfg.engine.device_memory_gb is not None:  # as on a smaller card: torch's allocator is capped
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, cfg.engine.device_memory_gb * 2**30 / total))
  deepspeed.init_distributed()
  conf = ds_config(cfg)
  if args.optimizer == "torch":
    del conf["optimizer"]
    conf["zero_force_ds_cpu_optimizer"] = False
  torch.set_default_dtype(torch.float32)
  with deepspeed.zero.Init(config_dict_or_path=conf):  # parameters go to host memory as built
    model = hf_model(m, t.seq)
  model.gradient_checkpointing_enable()
  client_opt = None
  if args.optimizer == "torch":
    o = cfg.optim
    client_opt = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=(o.b1, o.b2), eps=o.eps,
                                   weight_decay=o.weight_decay, fused=True)
  engine, optimizer, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                               optimizer=client_opt, config=conf)
  print(f"deepspeed {deepspeed.__version__}, torch {torch.__version__}, optimizer "
        f"{type(getattr(optimizer, 'optimizer', optimizer)).__name__}", flush=True)
  n_params = sum(getattr(q, "ds_numel", q.numel()) for q in model.parameters())
  expected = plan.param_counts(m)["total"]
  if n_params != expected:
    print(f"warning: transformers' model has {n_params:,} parameters, mtjax's shape {expected:,}")

  def step(ids):
    out = engine(input_ids=ids, labels=ids)  # transformers shifts the labels itself
    engine.backward(out.loss)
    engine.step()
    return out.loss.detach()

  record = timed(args, cfg, step, n_params, "cuda")
  record.update(deepspeed_version=deepspeed.__version__,
                optimizer=type(getattr(optimizer, "optimizer", optimizer)).__name__)
  write(args, record)
  return 0


def all_gpu(args, cfg: config_lib.Config) -> int:
  """Plain PyTorch on one GPU: fp32 master weights and AdamW state in device memory, bf16 compute."""
  import torch
  torch.manual_seed(0)
  m, o = cfg.model, cfg.optim
  model = hf_model(m, cfg.train.seq).cuda()
  if args.checkpointing:
    model.gradient_checkpointing_enable()
  n_params = sum(q.numel() for q in model.parameters())
  expected = plan.param_counts(m)["total"]
  if n_params != expected:
    print(f"warning: transformers' model has {n_params:,} parameters, mtjax's shape {expected:,}")
  opt = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=(o.b1, o.b2), eps=o.eps,
                          weight_decay=o.weight_decay, fused=True)
  bf16 = cfg.engine.compute_dtype == "bfloat16"
  print(f"torch {torch.__version__}, plain PyTorch all on the GPU, bf16 autocast {bf16}, "
        f"checkpointing {args.checkpointing}", flush=True)

  def step(ids):
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
      out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    opt.step()
    return out.loss.detach()

  record = timed(args, cfg, step, n_params, "cuda", system="torch-all-gpu")
  write(args, {**record, "optimizer": "AdamW(fused)", "checkpointing": args.checkpointing})
  return 0


def smoke(args, cfg: config_lib.Config) -> int:
  """The model and the record without DeepSpeed: plain torch AdamW on the CPU."""
  import torch
  torch.manual_seed(0)
  model = hf_model(cfg.model, cfg.train.seq)
  n_params = sum(q.numel() for q in model.parameters())
  expected = plan.param_counts(cfg.model)["total"]
  if n_params != expected:
    print(f"transformers' model has {n_params:,} parameters, mtjax's shape {expected:,}",
          file=sys.stderr)
    return 1
  o = cfg.optim
  opt = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=(o.b1, o.b2), eps=o.eps,
                          weight_decay=o.weight_decay)

  def step(ids):
    opt.zero_grad()
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    opt.step()
    return out.loss.detach()

  write(args, {**timed(args, cfg, step, n_params, "cpu"), "optimizer": "AdamW"})
  return 0


def timed(args, cfg: config_lib.Config, step, n_params: int, device: str,
          system: str = "deepspeed-zero3-offload") -> dict:
  """Median step time over `args.steps` after `args.warmup`, as a bench record."""
  import torch
  m, t = cfg.model, cfg.train
  sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
  times, loss = [], float("nan")
  for i in range(args.warmup + args.steps):
    b = data.synthetic_batch(i, t.batch, t.seq, m.vocab_size, t.seed)
    ids = torch.from_numpy(np.asarray(b.inputs, np.int64)).to(device)
    sync()
    t0 = time.perf_counter()
    loss = float(step(ids))
    sync()
    if i >= args.warmup:
      times.append(time.perf_counter() - t0)
    print(f"step {i}: loss {loss:.4f}, {time.perf_counter() - t0:.3f} s", flush=True)
  step_s = statistics.median(times)
  tokens = t.batch * t.seq
  counts = plan.param_counts(m)
  active = counts["active"] if n_params == counts["total"] else n_params
  rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None
  record = {
      "system": system, "params": n_params, "hidden": m.hidden,
      "layers": m.layers, "batch": t.batch, "seq": t.seq, "step_s": step_s,
      "active_params": active, "tokens_per_s": tokens / step_s,
      "model_tflops": 6 * active * tokens / step_s / 1e12,
      "hw_tflops": None, "host_bytes_per_param": rss / n_params,  # peak RSS, not state alone
      "device_peak_gib": peak, "h2d_gbps": None, "d2h_gbps": None,
      "host_opt_gparams_per_s": None, "gpu_idle_frac": None, "roofline_s": None, "loss": loss,
      "jax_version": None, "torch_version": torch.__version__,
      "device_memory_gb": cfg.engine.device_memory_gb}
  print(f"{system}: {step_s:.3f} s/step, {tokens / step_s:,.0f} tokens/s, "
        f"{record['model_tflops']:.1f} model TFLOP/s, peak RSS {rss / 2**30:.1f} GiB "
        f"({record['host_bytes_per_param']:.1f} B/param)"
        + ("" if peak is None else f", device peak {peak:.1f} GiB"))
  return record


def write(args, record: dict) -> None:
  if args.out:
    path = Path(args.out)
    old = json.loads(path.read_text()) if path.exists() else []
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(old + [record], indent=1))


if __name__ == "__main__":
  sys.exit(main())
