"""The step's time: parameter and FLOP counts, machine rates, and a simulation of the engine's
schedule over its four lanes (host->device copies, device compute, device->host copies, the host
optimizer). The measured figures behind the constants: docs/performance.md, the planner's
constants."""

from __future__ import annotations

import dataclasses

from mtjax import config as config_lib, models
from mtjax.models import qwen_vision

def param_counts(m: config_lib.ModelConfig) -> dict[str, int]:
  """Parameters: `total`, `active` per token (a mixture's unchosen experts left out), and one
  group's of each layer kind ("embed", "head", each block kind: mtjax.models.spec)."""
  return models.spec(m).counts


def count_params(m: config_lib.ModelConfig) -> int:
  """The model's parameters by arithmetic on its config, without laying out a layer (an absurd
  size is refused at once: `refuse_by_size`); equal to `param_counts(m)["total"]`, which
  tests/test_plan.py holds it to for every shipped config and drawn ones."""
  D, H, V = m.hidden, m.heads, m.vocab_size
  dense = lambda width, bias: 3 * D * width + (2 * width + D) * bias  # gate, up, down (+ biases)
  if m.mla is None:
    q, kv = H * m.dim_per_head, m.n_kv_heads * m.dim_per_head
    attn = 2 * D * q + 2 * D * kv + (q + 2 * kv) * m.qkv_bias + D * m.o_bias + H * m.attention_sinks
    attn += (D * q + q * m.qkv_bias) * m.attn_output_gate  # q_proj's gate half
    if m.qk_norm:
      attn += 2 * m.dim_per_head if m.qk_norm_scope == "head" else q + kv
  else:
    a = m.mla
    qk = H * (a.qk_nope_dim + a.qk_rope_dim)
    attn = (D * qk if a.q_lora_rank is None else (D + 1 + qk) * a.q_lora_rank)
    attn += (D * (a.kv_lora_rank + a.qk_rope_dim) + a.kv_lora_rank
             + a.kv_lora_rank * H * (a.qk_nope_dim + a.v_dim) + H * a.v_dim * D)
  norms = D * (2 * (m.norm_position != "post") + 2 * (m.norm_position != "pre"))
  block = norms + attn + dense(m.ffn, m.mlp_bias)
  moe_block = moe_layers = 0
  if m.moe is not None:
    e = m.moe
    E, F = e.experts, e.expert_ffn
    experts = 3 * E * D * F + (2 * E * F + E * D) * m.mlp_bias
    shared = (dense(e.shared_width, m.mlp_bias) + D * e.shared_gate
              if e.shared_experts or e.shared_ffn else 0)
    moe_block = (norms + attn + D * E + E * e.router_bias + E * e.score_correction_bias
                 + experts + shared)
    # layers i >= first_dense_layers with (i + 1) % every == 0, less the listed dense ones
    first = min(e.first_dense_layers, m.layers)
    moe_layers = m.layers // e.every - first // e.every - len(
        {i for i in e.dense_layers if first <= i < m.layers and (i + 1) % e.every == 0})
  linear = 0  # a gated DeltaNet's parameters beyond the attention it replaces
  if m.layer_types is not None and "linear" in m.layer_types:
    a = m.linear
    kd, vd, Hv = a.key_heads * a.key_dim, a.value_heads * a.value_dim, a.value_heads
    net = D * (2 * kd + 2 * vd) + 2 * D * Hv + (2 * kd + vd) * a.conv_kernel + 2 * Hv
    net += a.value_dim + vd * D  # the gated norm, out_proj
    linear = m.layer_types.count("linear") * (net - attn)
  head = D + (0 if m.tie_embeddings else D * V)
  return (V * D + (m.layers - moe_layers) * block + moe_layers * moe_block + linear + head
          + _tower_params(m))


def _tower_params(m: config_lib.ModelConfig) -> int:
  """A vision tower's parameters (mtjax.models.vision): the patch embedding, positions (CLIP's
  class token and pre-norm), its blocks and the projector (SigLIP's post-norm in it)."""
  v = m.vision
  if v is None:
    return 0
  if v.projector == "merger":  # a Qwen-VL tower
    return qwen_vision.params(m)
  Dv, F, D = v.hidden, v.ffn, m.hidden
  clip, siglip = v.tower == "clip", v.tower == "siglip"
  embed = v.channels * v.patch ** 2 * Dv + v.seq * Dv + 3 * Dv * clip + Dv * siglip
  block = 4 * Dv * Dv + 2 * Dv * F + 9 * Dv + F  # q, k, v, o and the MLP with biases; 2 norms
  if v.projector == "mlp":
    projector = Dv * D + D * D + 2 * D * v.projector_bias
  else:  # average pool, RMSNorm, one matrix
    projector = Dv * D + Dv
  return embed + v.layers * block + projector + 2 * Dv * siglip


def flops(cfg: config_lib.Config) -> dict[str, float]:
  """FLOPs of one training step at the config's batch and sequence length.

  `model`: 6 x active parameters x tokens, the usual count (attention's own matmuls left out; a
  mixture of experts counts the experts a token uses).
  `attention`: those matmuls, scores and values, forward and backward (3 x the forward), counting
  only the causal pairs a flash kernel computes, and for sliding layers those in the window; a
  gated DeltaNet layer's chunked scan in their place (`ModelSpec.mixer_forward_flops`).
  `with_attention`: their sum, the work a long context is judged by."""
  m, t = cfg.model, cfg.train
  spec = models.spec(m)
  model = 6 * spec.counts["active"] * t.batch * t.seq
  attention = 3 * spec.attention_forward_flops(t.batch, t.seq, causal_half=True)
  return {"model": float(model), "attention": float(attention),
          "with_attention": float(model + attention)}


# An AdamW update on the device reads weights, gradient and both moments and writes weights and
# moments back, all fp32: 28 bytes per parameter through device memory.
DEVICE_UPDATE_BYTES = 28


# The LM head's loss step moves each chunk's fp32 logits through device memory about six times
# (written, max and logsumexp, softmax, its gradient written, read by two matmuls): bytes per
# (token, vocabulary entry), beside its matmuls; at a large vocabulary a real share of the head.
HEAD_LOGIT_BYTES = 24
# Each chunk of the loss step also reads the head's fp32 weights and writes them as bf16 (6 bytes)
# and adds its fp32 gradient into the step's sum (12): bytes per (vocabulary entry, hidden unit)
# per chunk; measured on an H100 at the 1B shape, engine.loss_chunk 1024 beside 4096.
HEAD_CHUNK_BYTES = 16


@dataclasses.dataclass(frozen=True)
class Rates:
  """Machine rates for the step-time prediction (defaults: the lent H200 box, measured)."""
  matmul_tflops: float = 600.0  # bf16 dense matmul through jax.jit
  # cuDNN's fused causal attention, forward and backward, bf16, head_dim 128, at long context
  attention_tflops: float = 470.0
  h2d_gbps: float = 53.0  # pinned host -> device
  d2h_gbps: float = 53.0  # device -> pinned host
  # The fused in-place AdamW alone on 16 cores: the roofline's figure.
  host_adamw_gparams: float = 4.4
  # The same loop inside a training step, beside the device's compute and copies: fitted to the
  # host path (every group's state on the host) on the H200 boxes; the best another box ran is
  # the schedule's optimistic end.
  host_adamw_in_step_gparams: float = 3.4
  host_adamw_in_step_best_gparams: float = 4.2
  # The device's memory bandwidth (a large device-to-device copy, bytes read and written): an
  # update on the device and the LM head's softmax are bound by it.
  hbm_gbps: float = 4300.0
  accelerator: bool = True  # False: the CPU backend runs the layers (no CUDA runtime, no pinned pool)
  compute_capability: float = 9.0  # the GPU's (Hopper: 9.0): which attention kernels apply
  device_update_factor: float = 1.0  # a device update's time against float32 moments' (STATE_COSTS)
  state_dtype: str | None = None  # the moments these rates are for (for_state); None: float32's, unscaled

  def for_state(self, state_dtype: str) -> "Rates":
    """These rates for the fused AdamW with `state_dtype` moments (STATE_COSTS)."""
    if self.state_dtype is not None:
      raise ValueError(f"rates already for {self.state_dtype} moments")
    host, device = STATE_COSTS[state_dtype]
    return dataclasses.replace(
        self, host_adamw_gparams=self.host_adamw_gparams * host,
        host_adamw_in_step_gparams=self.host_adamw_in_step_gparams * host,
        host_adamw_in_step_best_gparams=self.host_adamw_in_step_best_gparams * host,
        device_update_factor=device, state_dtype=state_dtype)


# The fused AdamW's cost by optim.state_dtype against float32 moments', measured side by side
# (docs/performance.md, "Optimizer state"): the host loop's rate as a share of float32's, and a
# device update's time as a multiple of float32's (bfloat16's not measured: taken as float32's).
STATE_COSTS = {"float32": (1.0, 1.0), "bfloat16": (0.31, 1.0), "int8": (0.56, 2.27)}


@dataclasses.dataclass(frozen=True)
class Layer:
  """One layer group as the schedule sees it: parameters, device seconds forward and backward
  (the head's whole loss step counts as forward), saved-input bytes that cross the link, and
  whether it is frozen (train.freeze: no gradient leaves it, no update; its backward, if any,
  only passes the cotangent on)."""
  params: int
  fwd_s: float
  bwd_s: float
  saved_input_bytes: int
  frozen: bool = False


def simulate(layers: list[Layer], tiers, rates: Rates, inflight: int = 2, grad_queue: int = 4,
             overlap: bool = True, steps: int = 4, clip: str | None = None,
             moment_bytes: int = 8, passes: int = 1) -> float:
  """Predicted step time of the engine's schedule: four in-order lanes (host->device copies, device
  compute, device->host copies, the host optimizer) and the engine's dependencies between them.

  `tiers` gives each group's tier (an int k means: the first k groups streamed, the rest host).
  Forward, group g: host groups' weights are copied once their last update is done (stream and
  device groups' weights are on the device already), at most `inflight` layers ahead of the
  device. Backward, in reverse: weights (or, for stream groups, the optimizer state) come in, the
  gradient (or the optimizer state) goes out, and the host optimizer takes host groups in order;
  the device waits once more than `grad_queue` updates are queued. Device groups move nothing.
  Without overlap every item runs alone. Exact clipping (`clip`, optim.clip_mode) changes the
  backward: `host_buffer` applies every update only once the backward has ended (the host
  optimizer cannot overlap it); `recompute` runs a norm-only backward before the applying one.
  `moment_bytes`: a stream group's optimizer state per parameter (AdamW's m and v: 8, or 4 as
  bfloat16).
  `passes` (train.grad_accum; `layers` then hold one pass's seconds) runs that many forward and
  backward passes per step: before the last, host groups' gradients go out to their sums (which
  come back in from the second pass on, beside the weights) and nothing is updated.
  Steady state: the last step's length.
  """
  n = len(layers)
  if isinstance(tiers, int):
    tiers = ["stream"] * tiers + ["host"] * (n - tiers)
  h2d_rate, d2h_rate = rates.h2d_gbps * 1e9, rates.d2h_gbps * 1e9
  opt_rate = rates.host_adamw_in_step_gparams * 1e9
  hbm_rate = rates.hbm_gbps * 1e9
  free = {"h2d": 0.0, "compute": 0.0, "d2h": 0.0, "opt": 0.0}
  updated = [0.0] * n  # when group g's last update finished
  moments_back = [0.0] * n  # when a stream group's optimizer state was last back in host memory
  starts = []

  def run(lane, ready, dur):
    start = max(free[lane], ready)
    if not overlap:
      start = max(start, *free.values())
    free[lane] = start + dur
    return free[lane]

  def _update(g, ready):
    """Group g's update, its gradient ready at `ready` (on the host for host groups)."""
    lay, tier = layers[g], tiers[g]
    if tier == "stream":  # m and v go back; the device's new weights stay for the next forward
      updated[g] = run("compute", ready, lay.params * DEVICE_UPDATE_BYTES
                       * rates.device_update_factor / hbm_rate)
      moments_back[g] = run("d2h", updated[g], moment_bytes * lay.params / d2h_rate)
    elif tier == "device":
      updated[g] = run("compute", ready, lay.params * DEVICE_UPDATE_BYTES
                       * rates.device_update_factor / hbm_rate)
    else:
      updated[g] = run("opt", ready, lay.params / opt_rate)
      opt_done.append(updated[g])

  for _ in range(steps):
    host_t = free["compute"]  # the host syncs on the loss and norms at the end of a step
    starts.append(host_t)
    for p in range(passes):
      summed = 4 * (p > 0)  # bytes/param: a host group's sum of the earlier passes comes in
      done = [0.0] * n  # forward compute done
      for g, lay in enumerate(layers):
        gate = done[g - 1 - inflight] if g - 1 - inflight >= 0 else host_t
        arrived = (updated[g] if tiers[g] != "host" else
                   run("h2d", max(updated[g], gate), 4 * lay.params / h2d_rate))
        done[g] = run("compute", max(arrived, gate), lay.fwd_s)
        if lay.saved_input_bytes:
          run("d2h", done[g], lay.saved_input_bytes / d2h_rate)
      # clip="recompute": a norm-only backward first (nothing updated), then the applying one;
      # before the last pass, gradients go to their sums and nothing is updated
      last = p == passes - 1
      for applying in ((False, True) if clip == "recompute" else (True,)) if last else (False,):
        landing = applying or not last  # the gradient goes on: to its update, or its sum
        opt_done: list[float] = []  # host updates of this backward, in order
        held = []  # clip="host_buffer": (group, gradient landed) until the backward has ended
        bwd_done = [0.0] * n
        for g in reversed(range(n)):
          gate = opt_done[-grad_queue - 1] if len(opt_done) > grad_queue else host_t
          if g + 2 + inflight < n:
            gate = max(gate, bwd_done[g + 2 + inflight])
          lay, tier = layers[g], tiers[g]
          if lay.frozen:  # its weights come in only where its backward runs; nothing goes out
            if g < n - 1 and lay.bwd_s:
              nbytes = (4 * lay.params if tier == "host" else 0) + lay.saved_input_bytes
              arrived = run("h2d", gate, nbytes / h2d_rate) if nbytes else gate
              bwd_done[g] = run("compute", max(arrived, gate), lay.bwd_s)
            else:
              bwd_done[g] = done[-1] if g == n - 1 else gate
            continue
          streamed = tier == "stream" and applying
          if g == n - 1:  # the head's gradient exists once its (forward) step ran
            computed = done[-1]
            if streamed:  # its moments, for the device update, once last step's are back
              run("h2d", max(gate, moments_back[g]), moment_bytes * lay.params / h2d_rate)
            elif tier == "host" and summed and landing:  # its sum, to add its gradient to
              run("h2d", gate, summed * lay.params / h2d_rate)
          else:
            # weights (the embedding's backward needs none), or only the moments when streamed
            nbytes = {"stream": moment_bytes * lay.params * applying,
                      "host": (4 * (g > 0) + summed * landing) * lay.params,
                      "device": 0}[tier] + lay.saved_input_bytes
            ready = max(gate, moments_back[g]) if streamed else gate
            arrived = run("h2d", ready, nbytes / h2d_rate) if nbytes else ready
            computed = run("compute", max(arrived, gate), lay.bwd_s)
          bwd_done[g] = computed
          if not landing:
            continue
          landed = run("d2h", computed, 4 * lay.params / d2h_rate) if tier == "host" else computed
          if not applying:
            continue
          if clip == "host_buffer":
            held.append((g, landed))
            continue
          _update(g, landed)
        end = free["compute"]  # the global norm is known: held gradients are applied in order
        for g, landed in held:
          _update(g, max(landed, end))
  return starts[-1] - starts[-2]
