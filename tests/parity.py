"""The parity harness every model family's tests use: a tiny random transformers model saved to a
directory, imported by mtjax, held to transformers' own fp32 eager forward and torch autograd.

Each check compares against transformers (torch, CPU, fp32, eager attention) with
tests/numerics.py's criteria: logits and the loss, every parameter's gradient, one AdamW step (the
streaming engine on the imported model against torch.optim.AdamW), and an export that transformers
loads back into the same logits.
"""

from __future__ import annotations

import dataclasses
import functools
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import safetensors.numpy
import torch
import transformers

import mtjax
from mtjax import cli, data, engine as engine_lib, hf, launch, models, store as store_lib
from mtjax.models.layers import token_nll
from numerics import REL_L2, assert_close, errors

def covers(*families: str):
  """Marks a test as the one holding these families to transformers; the test fails unless it
  imports a checkpoint of one of them (through `mtjax.load_hf`), and tests/test_hf.py fails while
  a registered family has no such test."""
  def mark(test):
    @functools.wraps(test)
    def run(*args, **kwargs):
      seen, load_hf = [], mtjax.load_hf

      def recorded(path):
        cfg, params = load_hf(path)
        seen.append(cfg.family)
        return cfg, params

      mtjax.load_hf = recorded
      try:
        test(*args, **kwargs)
      finally:
        mtjax.load_hf = load_hf
      assert seen and set(seen) <= set(families), (families, seen)
    run.families = families
    return run
  return mark


# Parameters whose transformers init is a constant (norms at 1 or 0, biases at 0, sinks, score
# correction biases): moved off it, so a wrong offset or a dropped bias cannot hide.
_CONSTANT_INIT = ("norm.weight", "layernorm.weight", ".bias", "_bias", "sinks",
                  "e_score_correction_bias")


def save_tiny(config, directory: Path, seed: int = 0, dtype=torch.float32, shard: str = "10MB",
              std: float = 0.3) -> torch.nn.Module:
  """A random transformers model of `config`, its constant-init parameters drawn N(0, std) around
  their init, saved to `directory`; the fp32 model is returned (eval mode, eager attention)."""
  torch.manual_seed(seed)
  config._attn_implementation = "eager"
  m = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
  with torch.no_grad():
    for name, p in m.named_parameters():
      if any(k in name for k in _CONSTANT_INIT):
        p.add_(std * torch.randn_like(p))
    for name, b in m.named_buffers():  # DeepSeek-V3's score correction bias is a buffer
      if name.endswith("e_score_correction_bias"):
        b.add_(0.1 * torch.randn_like(b))
  m.to(dtype).save_pretrained(directory, max_shard_size=shard)
  return m.float().eval()


def token_ids(vocab: int, B: int = 2, T: int = 12, seed: int = 0) -> np.ndarray:
  return np.random.default_rng(seed).integers(0, vocab, (B, T)).astype(np.int32)


@dataclasses.dataclass
class TorchResult:
  logits: np.ndarray  # [B, T, V] of the inputs
  loss: float  # mean cross-entropy of the targets, plus the weighted auxiliary loss
  aux: float  # transformers' own auxiliary (load-balancing) loss, unweighted; 0 without
  grads: dict  # parameter name -> gradient of `loss`


def as_checkpoint(m: torch.nn.Module, values: dict | None = None) -> dict[str, np.ndarray]:
  """A transformers model's parameters (or `values` in their place, by parameter name) under the
  names and layouts of its saved checkpoint, as save_pretrained converts them: transformers 5
  fuses a mixture's per-expert tensors into stacked ones when it loads and splits them again when
  it saves. Buffers the checkpoint carries (a router's score-correction bias) keep their values."""
  if values is not None:
    params = dict(m.named_parameters())
    saved = {k: p.detach().clone() for k, p in params.items()}
    with torch.no_grad():
      for k, v in values.items():
        params[k].copy_(torch.as_tensor(v))
  try:
    with tempfile.TemporaryDirectory() as d:
      m.save_pretrained(d, safe_serialization=True)
      out = {}
      for f in sorted(Path(d).glob("*.safetensors")):
        out.update(safetensors.numpy.load_file(f))
  finally:
    if values is not None:
      with torch.no_grad():
        for k, v in saved.items():
          params[k].copy_(v)
  return {k: np.asarray(v, np.float32) for k, v in out.items()}


def torch_reference(directory: Path, inputs: np.ndarray, targets: np.ndarray,
                    aux_coef: float = 0.0) -> TorchResult:
  """transformers' fp32 eager forward of `inputs` and torch autograd of mean CE(targets) plus
  aux_coef x the router's load-balancing loss (asked for with output_router_logits); the
  gradients by checkpoint name (`as_checkpoint`; a buffer's entry, which gets none, is 0)."""
  m = transformers.AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager",
                                                        dtype=torch.float32)
  m.train(False)
  kw = {"output_router_logits": True} if aux_coef else {}
  out = m(torch.from_numpy(inputs).long(), **kw)
  ce = torch.nn.functional.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]),
                                         torch.from_numpy(targets).long().reshape(-1))
  aux = getattr(out, "aux_loss", None)
  loss = ce + aux_coef * aux if aux_coef else ce
  loss.backward()
  grads = {k: (p.grad if p.grad is not None else torch.zeros_like(p)).numpy()
           for k, p in m.named_parameters()}
  by_name = as_checkpoint(m, grads)
  # A buffer the checkpoint carries (not a parameter) gets no gradient: it is what stays nonzero
  # when every parameter is saved as zeros.
  zeros = as_checkpoint(m, {k: np.zeros_like(v) for k, v in grads.items()})
  for k, v in zeros.items():
    if np.any(v != 0):
      by_name[k] = np.zeros_like(by_name[k])
  return TorchResult(out.logits.detach().numpy(), float(loss),
                     0.0 if aux is None else float(aux), by_name)


def mtjax_loss_and_grads(cfg, params, inputs, targets):
  """mean CE of the targets plus the weighted auxiliary loss through `mtjax.forward`, and its
  gradient by Hugging Face name (one jit: compiled once, not op by op)."""
  @jax.jit
  def loss_and_grad(params, inputs, targets):
    def loss_fn(params):
      logits, aux_loss, _ = mtjax.forward(cfg, params, inputs, aux=True)
      nll = token_nll(logits.reshape(-1, cfg.vocab_size), targets.reshape(-1))
      return jnp.mean(nll) + aux_loss
    return jax.value_and_grad(loss_fn)(params)

  loss, grads = loss_and_grad(params, jnp.asarray(inputs), jnp.asarray(targets))
  return float(loss), mtjax.to_hf_names(cfg, grads)


@functools.partial(jax.jit, static_argnums=0)
def _forward(cfg, params, ids):
  return mtjax.forward(cfg, params, ids)


def forward(cfg, params, ids):
  """`mtjax.forward`'s logits, jitted (one compile per config and shape: the parity check, each
  feature's base and the export's check share one)."""
  return np.asarray(_forward(cfg, params, jnp.asarray(ids)))


def check_logits_and_gradients(directory: Path, aux_coef: float = 0.0, B: int = 2, T: int = 12):
  """The imported model's logits, loss and every gradient equal transformers' (fp32 rounding);
  returns (cfg, params, the torch result)."""
  cfg, params = mtjax.load_hf(directory)
  ids = token_ids(cfg.vocab_size, B, T + 1)
  inputs, targets = ids[:, :-1], ids[:, 1:]
  want = torch_reference(directory, inputs, targets, aux_coef)
  got = forward(cfg, params, inputs)
  assert 0.05 < np.abs(want.logits).mean() < 20  # logits of a scale where the bounds mean fp32
  assert_close(got, want.logits, name="logits")
  assert np.max(np.abs(got - want.logits)) <= 1e-4
  loss, grads = mtjax_loss_and_grads(cfg, params, inputs, targets)
  assert_close(loss, want.loss, name="loss")
  assert grads.keys() == want.grads.keys(), grads.keys() ^ want.grads.keys()
  for name in want.grads:
    assert_close(grads[name], want.grads[name], name=name)
  return cfg, params, want


def check_adamw_step(directory: Path, aux_coef: float = 0.0, lr: float = 1e-2,
                     weight_decay: float = 0.1, B: int = 2, T: int = 12, eps: float = 1e-4,
                     **overrides):
  """One step of the streaming engine (fp32, fused AdamW, the layer groups spread over every
  tier) on the imported model equals torch.optim.AdamW on transformers' model: the same loss,
  decay on matrices only.

  Adam's first step is lr * g / (|g| + eps): its sensitivity to a gradient element's rounding is
  lr * eps / (|g| + eps)^2, up to lr / eps for a gradient near eps. With eps 1e-8 a gradient of
  1e-7 turns fp32 rounding (1e-8 of it) into a weight difference of 5e-5 (GELU's and SwiGLU's
  near-zero derivatives hold such gradients); eps 1e-4, on both sides, bounds the amplification
  at 100."""
  over = [f"model.from_hf={directory}", "engine.compute_dtype=float32", "engine.devices=1",
          f"train.batch={B}", f"train.seq={T}", f"optim.lr={lr}", "optim.warmup_steps=0",
          "optim.min_lr_ratio=1.0", f"optim.weight_decay={weight_decay}", "optim.b2=0.99",
          f"optim.eps={eps}",
          "engine.device_state_layers=1", "engine.device_update_layers=1",
          *(f"{k}={v}" for k, v in overrides.items())]
  cfg, _ = launch.plan_run(cli.load_config(None, over))
  st = store_lib.create(cfg, jax.random.key(0))
  hf.load_into(st, directory)
  ids = token_ids(cfg.model.vocab_size, B, T + 1, seed=5)
  eng = engine_lib.Engine(cfg, st)
  stats = eng.step(data.Batch(ids[:, :-1], ids[:, 1:]))
  eng.sync()
  got = mtjax.to_hf_names(cfg.model, st.to_tree())
  eng.close()

  m = transformers.AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager",
                                                        dtype=torch.float32)
  decay = [p for n, p in m.named_parameters() if p.ndim >= 2 and not n.endswith("bias")]
  rest = [p for n, p in m.named_parameters() if not (p.ndim >= 2 and not n.endswith("bias"))]
  o = cfg.optim
  opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                           {"params": rest, "weight_decay": 0.0}], lr=lr, betas=(o.b1, o.b2),
                          eps=o.eps)
  kw = {"output_router_logits": True} if aux_coef else {}
  inputs = torch.from_numpy(ids[:, :-1]).long()
  out = m(inputs, **kw)
  loss = torch.nn.functional.cross_entropy(out.logits.reshape(-1, cfg.model.vocab_size),
                                           torch.from_numpy(ids[:, 1:]).long().reshape(-1))
  assert_close(stats.loss, float(loss), name="cross-entropy before the step")
  if aux_coef:
    loss = loss + aux_coef * out.aux_loss
    assert_close(stats.aux["aux_loss"], aux_coef * float(out.aux_loss), name="auxiliary loss")
  loss.backward()
  opt.step()
  want = as_checkpoint(m)  # the stepped model under checkpoint names
  assert set(got) == set(want), set(got) ^ set(want)
  for name in want:
    # Adam's per-coordinate step is up to lr whatever the gradient: 1e-3 lr per element allowed
    # (see tests/numerics.py, atol).
    assert_close(got[name], want[name], atol=1e-3 * lr, name=name)
  return stats


def check_export(cfg, params, tmp: Path, dtype: str = "float32", source: Path | None = None):
  """An export (from the parameters, with the source's config or the family's own) loads in
  transformers and gives mtjax's logits."""
  spec = models.spec(cfg)
  parts = [params["embed"], *params["blocks"], params["head"]]
  groups = ((g, spec.group_layout(g).flatten(p)) for (g, _), p in zip(spec.groups, parts))
  out = hf.export(tmp, cfg, groups, dtype=dtype, source_dir=source)
  m = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager",
                                                        dtype=torch.float32)
  ids = token_ids(cfg.vocab_size, seed=3)
  with torch.no_grad():
    theirs = m(torch.from_numpy(ids).long()).logits.numpy()
  assert_close(forward(cfg, params, ids), theirs, name="logits of the reloaded export")
  back, _ = mtjax.load_hf(out)
  assert dataclasses.replace(back, from_hf=None) == dataclasses.replace(cfg, from_hf=None)
  return out


def feature_matters(cfg, params, T: int = 12, factor: float = 100.0, base=None, **change) -> float:
  """How far the logits move when the config is changed (a feature turned off), relative L2; it
  must exceed `factor` times the parity bound for the parity tests to have tested the feature.
  A section's change is a dict of its fields (`rope=dict(truncate=True)`). `base`: the unchanged
  model's logits of `token_ids(vocab, T=T)`, when already computed."""
  change = {k: dataclasses.replace(getattr(cfg, k), **v) if isinstance(v, dict) else v
            for k, v in change.items()}
  ids = token_ids(cfg.vocab_size, T=T)
  base = forward(cfg, params, ids) if base is None else base
  other = forward(dataclasses.replace(cfg, **change), params, ids)
  moved = errors(other, base)[0]
  assert moved > factor * REL_L2, (change, moved)
  return moved


def pieces_cover_every_parameter(cfg):
  """Every parameter element is filled by exactly one piece of the family's tensor map, and no two
  pieces of a tensor overlap."""
  spec = models.spec(cfg)
  for g, _ in spec.groups:
    lay = spec.group_layout(g)
    counts = lay.unflatten(np.zeros(lay.size, np.int32))
    tensors = {}
    for p in spec.family.pieces(cfg, g, lay):
      node = counts
      for k in p.path:
        node = node[k]
      target = node[p.dst] if p.dst else node
      target += 1
      t = tensors.setdefault(p.name, np.zeros(p.shape, np.int32))
      (t[p.src] if p.src else t)[...] += 1
    for path in lay.paths:
      c = counts
      for k in path:
        c = c[k]
      assert (c == 1).all(), (g, path, np.unique(c))
    for name, t in tensors.items():
      assert (t == 1).all(), (g, name, np.unique(t))
