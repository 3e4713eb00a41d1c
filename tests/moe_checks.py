"""What the mixture-of-experts families check beyond tests/parity.py: every token's routing and the
load-balancing loss against transformers'."""

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers

import mtjax
import parity
from mtjax.models import moe
from numerics import assert_close


def router_calls(model, ids):
  """(layer index, router input [N, D], transformers' (logits, weights, experts)) of every MoE
  layer, caught by forward hooks on its router module (`mlp.gate`)."""
  calls = []
  hooks = [layer.mlp.gate.register_forward_hook(
      lambda mod, args, out, i=i: calls.append((i, args[0], out)))
      for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "gate")]
  with torch.no_grad():
    model(torch.from_numpy(ids).long())
  for h in hooks:
    h.remove()
  return calls


def check_routing(directory, cfg, params):
  """mtjax routes the inputs of transformers' routers (every token of every MoE layer) to the
  same experts with the same weights (a score correction bias included)."""
  model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                            attn_implementation="eager")
  calls = router_calls(model, parity.token_ids(cfg.vocab_size))
  assert [i for i, _, _ in calls] == [i for i in range(cfg.layers) if cfg.is_moe_layer(i)]
  for i, x, (logits, weights, experts) in calls:
    mlp = params["blocks"][i]["mlp"]
    got_logits = x.numpy().reshape(-1, cfg.hidden) @ np.asarray(mlp["router"]["kernel"])
    assert_close(got_logits, logits.numpy(), name=f"layer {i} router logits")
    got_w, got_e = moe.route(cfg, jnp.asarray(got_logits), mlp.get("e_bias"))
    # each token's choices in expert order (a router's top-k may come unsorted: GLM-4.5's)
    mine, theirs = np.argsort(got_e, axis=-1), np.argsort(experts.numpy(), axis=-1)
    assert np.array_equal(np.take_along_axis(np.asarray(got_e), mine, -1),
                          np.take_along_axis(experts.numpy(), theirs, -1)), i
    assert_close(np.take_along_axis(np.asarray(got_w), mine, -1),
                 np.take_along_axis(weights.numpy(), theirs, -1), name=f"layer {i} routing weights")


def check_aux_loss(cfg, params, want: parity.TorchResult, coef: float):
  """The load-balancing loss of the harness's inputs equals transformers' `aux_loss` output, and
  the training loss adds it weighted by config.json's router_aux_loss_coef."""
  assert cfg.moe.aux_loss_coef == coef
  inputs = parity.token_ids(cfg.vocab_size, 2, 13)[:, :-1]  # check_logits_and_gradients'
  _, aux, metrics = jax.jit(lambda p: mtjax.forward(cfg, p, inputs, aux=True))(params)
  assert_close(float(metrics["load_balance"]), want.aux, name="load-balancing loss")
  assert_close(float(aux), coef * want.aux, name="weighted auxiliary loss")
