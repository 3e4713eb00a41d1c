"""The planner: its figures against real allocations, and refusal before anything is allocated."""

import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import pytest
from hypothesis import given, strategies as hst

from mtjax import config, plan, state as state_lib, train

CONFIGS = Path(__file__).parent.parent / "configs"


@given(heads=hst.sampled_from([2, 4]), kv=hst.sampled_from([1, 2]), bias=hst.booleans(),
       tied=hst.booleans(), layers=hst.integers(1, 3), head_dim=hst.sampled_from([None, 8]))
def test_param_counts_equal_the_real_layouts(heads, kv, bias, tied, layers, head_dim):
  m = config.ModelConfig(vocab_size=50, hidden=32, layers=layers, heads=heads, kv_heads=kv,
                         head_dim=head_dim, ffn=40, qkv_bias=bias, tie_embeddings=tied)
  lays = state_lib.layouts(m)
  pc = plan.param_counts(m)
  assert (pc["embed"], pc["block"], pc["head"]) == (lays["embed"].size, lays["block"].size,
                                                     lays["head"].size)
  assert pc["total"] == state_lib.create(m, jax.random.key(0)).n_params


def test_shipped_shapes_have_their_nominal_sizes():
  sizes = {f: plan.param_counts(config.load(CONFIGS / f).model)["total"] / 1e9
           for f in ("llama_1b.yaml", "llama_3b.yaml", "llama_7b.yaml", "llama_9b.yaml")}
  assert sizes == pytest.approx({"llama_1b.yaml": 0.95, "llama_3b.yaml": 3.37,
                                 "llama_7b.yaml": 6.74, "llama_9b.yaml": 9.17}, abs=0.01)


def test_host_state_figures_equal_the_allocation():
  cfg = config.load(CONFIGS / "tiny.yaml")
  p = plan.make(cfg)
  st = state_lib.create(cfg.model, jax.random.key(0))
  assert p.host["master weights"] + p.host["AdamW moments"] == st.host_bytes()
  assert p.host_bytes_per_param == 12.0
  buffered = plan.make(config.load(CONFIGS / "tiny.yaml", ["optim.clip_norm=1.0"]))
  assert buffered.host["clip gradient buffer"] == 4 * st.n_params  # said plainly: +4 B/param
  recompute = plan.make(config.load(CONFIGS / "tiny.yaml", ["optim.clip_norm=1.0",
                                                            "optim.clip_mode=recompute"]))
  assert recompute.host["clip gradient buffer"] == 0


def test_peak_rss_during_init_stays_near_the_state(tmp_path):
  # One 16-block model of ~29M params (350 MB of state); init may add a few layers on top.
  script = textwrap.dedent("""
      import resource, jax, numpy as np
      from mtjax import config, state, plan
      jax.numpy.zeros(1).block_until_ready()
      m = config.ModelConfig(vocab_size=512, hidden=384, layers=16, heads=6, ffn=1024)
      base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
      st = state.create(m, jax.random.key(0))
      peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
      layer = 12 * max(g.layout.size for g in st.groups)
      print(peak - base, st.host_bytes(), layer)
  """)
  out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
  grown, state_bytes, layer = map(int, out.stdout.split())
  assert grown <= state_bytes + 4 * layer, (grown, state_bytes, layer)


def test_run_that_cannot_fit_is_refused_before_allocation(monkeypatch):
  cfg = config.load(CONFIGS / "llama_7b.yaml")
  monkeypatch.setattr(plan, "host_memory_limit", lambda: 64 * 2**30)
  monkeypatch.setattr(state_lib, "create", lambda *a, **k: pytest.fail("allocated before refusing"))
  with pytest.raises(plan.PlanError, match=r"host memory: needs 80\.\d GiB .* limit 64\.0 GiB"):
    train.run(cfg, progress=False)


def test_device_refusal_names_the_largest_item():
  cfg = config.load(CONFIGS / "llama_3b.yaml", ["train.batch=64", "engine.micro_batch=64"])
  p = plan.make(cfg, device_limit=8 * 2**30)
  with pytest.raises(plan.PlanError, match="device memory: needs .* limit 8.0 GiB; lower train.batch"):
    plan.check(p)


def test_plan_cli_and_train_cli_refusal():
  r = subprocess.run([sys.executable, "-m", "mtjax.plan", "--config", str(CONFIGS / "tiny.yaml"),
                      "--no-device"], capture_output=True, text=True)
  assert r.returncode == 0 and "fits" in r.stdout and "predicted step" in r.stdout
  r = subprocess.run([sys.executable, "-m", "mtjax.train", "--config", str(CONFIGS / "tiny.yaml"),
                      "model.layers=2000000"], capture_output=True, text=True)
  assert r.returncode == 2
  assert r.stderr.startswith("refused: does not fit in host memory") and r.stderr.count("\n") == 1


LAYERS = [plan.Layer(100, 0.0, 0.0, 0)] + [plan.Layer(300, 0.002, 0.006, 50)] * 3 + [
    plan.Layer(200, 0.004, 0.0, 0)]
# 1000 B/s in, 2000 B/s out, 500 param/s on the host
RATES = plan.Rates(h2d_gbps=1e-6, d2h_gbps=2e-6, host_adamw_in_step_gparams=5e-7)


@given(k=hst.integers(0, 5))
def test_serial_schedule_is_the_sum_of_its_items(k):
  # Reference: every copy, kernel and update of one step, added up by hand.
  h2d, d2h = 1e3, 2e3
  total = 0.0
  for g, lay in enumerate(LAYERS):
    total += lay.fwd_s + lay.bwd_s + lay.checkpoint_bytes / d2h  # kernels, saved input out
    if g < k:  # resident weights: only the moments come in
      total += 8 * lay.params / h2d + 8 * lay.params / d2h  # moments in and out
    else:
      back = 4 * lay.params if 0 < g < len(LAYERS) - 1 else 0  # embedding and head need none
      total += (4 * lay.params + back) / h2d + 4 * lay.params / d2h + lay.params / 500
    if 0 < g < len(LAYERS) - 1:
      total += lay.checkpoint_bytes / h2d  # saved input back in for the backward
  assert plan.simulate(LAYERS, k, RATES, overlap=False) == pytest.approx(total, rel=1e-9)


@pytest.mark.parametrize("k", range(6))
@pytest.mark.parametrize("in_out", [(1e3, 2e3), (4e3, 500.0)])  # link bytes/s each way
@given(inflight=hst.integers(1, 3), queue=hst.integers(1, 4))
def test_overlapped_schedule_lies_between_its_busiest_lane_and_the_serial_sum(k, in_out, inflight,
                                                                             queue):
  rates = plan.Rates(h2d_gbps=in_out[0] / 1e9, d2h_gbps=in_out[1] / 1e9,
                     host_adamw_in_step_gparams=5e-7)
  step = plan.simulate(LAYERS, k, rates, inflight, queue)
  host = sum(lay.params for lay in LAYERS[k:]) / 500
  compute = sum(lay.fwd_s + lay.bwd_s for lay in LAYERS)
  # Every step moves these bytes each way (see the serial test for the items).
  out = sum((8 if g < k else 4) * lay.params + lay.checkpoint_bytes for g, lay in enumerate(LAYERS))
  inward = sum(8 * lay.params if g < k else 4 * lay.params * (1 + (0 < g < len(LAYERS) - 1))
               for g, lay in enumerate(LAYERS)) + sum(lay.checkpoint_bytes for lay in LAYERS)
  assert max(host, compute, out / in_out[1], inward / in_out[0]) <= step * (1 + 1e-9)
  assert step <= plan.simulate(LAYERS, k, rates, inflight, queue, overlap=False)


def test_planner_picks_device_updates_only_where_they_pay_and_fit():
  cfg = config.load(CONFIGS / "llama_3b.yaml")
  # A device update sends m and v back (8 B/param) where the host path sends the gradient (4): with
  # a slow device->host link and a fast host optimizer, most groups stay on the host.
  slow_link = plan.Rates(h2d_gbps=1e4, d2h_gbps=5, host_adamw_in_step_gparams=1e3)
  k = plan.choose_device_updates(cfg, rates=slow_link)
  times = [plan.make(config.load(CONFIGS / "llama_3b.yaml", [f"engine.device_update_layers={n}"]),
                     rates=slow_link).schedule_s for n in range(cfg.model.layers + 3)]
  assert k < cfg.model.layers // 4 and times[k] <= 1.02 * min(times)
  assert all(t > 1.02 * min(times) for t in times[k + 1:])  # the largest count within 2%
  slow_host = plan.Rates(host_adamw_in_step_gparams=0.5)
  everything = plan.choose_device_updates(cfg, rates=slow_host)
  assert everything > cfg.model.layers // 2
  six = config.load(CONFIGS / "llama_3b.yaml", ["engine.device_update_layers=6"])
  limit = plan.make(six).device_total  # room for six device-updated groups, no more
  k = plan.choose_device_updates(cfg, device_limit=limit, rates=slow_host)
  assert k == 6
  auto = config.load(CONFIGS / "llama_3b.yaml", ["engine.device_update_layers=auto"])
  chosen = plan.make(auto, device_limit=limit, rates=slow_host)
  assert chosen.device_update_layers == k and chosen.fits_device
  # Pinned moments enlarge the pinned pool: a host limit just above the all-host plan keeps them off.
  tight = plan.make(cfg).host_total + 2**30
  assert plan.make(auto, host_limit=tight, rates=slow_host).device_update_layers == 0


def test_device_update_layers_accepts_auto_and_refuses_other_words():
  assert config.load(CONFIGS / "tiny.yaml", ["engine.device_update_layers=auto"]
                     ).engine.device_update_layers == "auto"
  with pytest.raises(config.ConfigError, match="engine.device_update_layers"):
    config.load(CONFIGS / "tiny.yaml", ["engine.device_update_layers=most"])
