"""The planner: its figures against real allocations, and refusal before anything is allocated."""

import dataclasses
import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import pytest
from hypothesis import assume, given, settings, strategies as hst

from mtjax import config, exits, launch, models, plan, store as store_lib, train
from mtjax.plan import __main__ as plan_cli

CONFIGS = Path(__file__).parent.parent / "configs"


@given(heads=hst.sampled_from([2, 4]), kv=hst.sampled_from([1, 2]), bias=hst.booleans(),
       tied=hst.booleans(), layers=hst.integers(1, 3), head_dim=hst.sampled_from([None, 8]),
       qk_norm=hst.booleans())
def test_param_counts_equal_the_llama_formula(heads, kv, bias, tied, layers, head_dim, qk_norm):
  m = config.ModelConfig(vocab_size=50, hidden=32, layers=layers, heads=heads, kv_heads=kv,
                         head_dim=head_dim, ffn=40, qkv_bias=bias, tie_embeddings=tied,
                         qk_norm=qk_norm)
  D, F, hd = m.hidden, m.ffn, m.dim_per_head
  q, k = m.heads * hd, m.n_kv_heads * hd
  block = (D * q + 2 * D * k + q * D + 3 * D * F + 2 * D + (q + 2 * k if bias else 0)
           + (2 * hd if qk_norm else 0))
  embed, head = m.vocab_size * D, D + (0 if tied else D * m.vocab_size)
  pc = plan.param_counts(m)
  assert (pc["embed"], pc["block"], pc["head"]) == (embed, block, head)
  assert pc["total"] == pc["active"] == embed + layers * block + head
  cfg = config.Config(model=m, engine=config.EngineConfig(device_state_layers=0, device_update_layers=0))
  assert pc["total"] == store_lib.create(cfg, jax.random.key(0)).n_params


def test_shipped_shapes_have_their_nominal_sizes():
  sizes = {f: plan.param_counts(config.load(CONFIGS / f).model)["total"] / 1e9
           for f in ("llama_1b.yaml", "llama_3b.yaml", "llama_7b.yaml", "llama_9b.yaml")}
  assert sizes == pytest.approx({"llama_1b.yaml": 0.95, "llama_3b.yaml": 3.37,
                                 "llama_7b.yaml": 6.74, "llama_9b.yaml": 9.17}, abs=0.01)


@pytest.mark.parametrize("placement", [(0, 0), (1, 2), (4, 0)])
def test_state_figures_equal_the_allocation(placement):
  n_state, n_stream = placement
  over = [f"engine.device_state_layers={n_state}", f"engine.device_update_layers={n_stream}"]
  cfg, p = launch.plan_run(config.load(CONFIGS / "tiny.yaml", over))
  st = store_lib.create(cfg, jax.random.key(0))
  allocated = st.allocated_bytes()  # summed over the buffers the store really holds
  assert p.host["master weights"] + p.host["optimizer state"] == allocated["host"] + allocated["pinned"]
  assert p.device["weights and optimizer state (device tier)"] == allocated["device"]
  assert p.host_bytes_per_param == 12.0 and p.tiers == tuple(st.tiers())
  host = ["engine.device_state_layers=0", "engine.device_update_layers=0"]
  buffered = plan.make(config.load(CONFIGS / "tiny.yaml", ["optim.clip_norm=1.0", *host]))
  assert buffered.host["clip gradient buffer"] == 4 * st.n_params  # said plainly: +4 B/param
  recompute = plan.make(config.load(CONFIGS / "tiny.yaml", ["optim.clip_norm=1.0",
                                                            "optim.clip_mode=recompute", *host]))
  assert recompute.host["clip gradient buffer"] == 0
  st.close()


@pytest.mark.parametrize("name", ["lion", "adafactor"])
def test_optimizer_state_of_any_optax_rule_is_counted_as_allocated(name):
  cfg, p = launch.plan_run(config.load(CONFIGS / "tiny.yaml", [f"optim.name={name}"]))
  st = store_lib.create(cfg, jax.random.key(0))
  allocated = st.allocated_bytes()
  assert p.host["master weights"] + p.host["optimizer state"] == allocated["host"] + allocated["pinned"]
  assert p.host["optimizer state"] < 8 * st.n_params  # lion: one moment; adafactor: factored
  st.close()


def test_device_bytes_of_the_layers_come_from_the_compiled_executables():
  cfg = config.load(CONFIGS / "tiny.yaml", ["engine.device_state_layers=0"])
  working = launch.compiled_memory(cfg)
  assert set(working) == {"embed forward", "block forward", "block backward", "head",
                          "embed backward"}
  # The block backward holds at least its activations' cotangents: [B, T, ffn] fp32 a few times.
  t, m = cfg.train, cfg.model
  assert working["block backward"]["temp"] >= 3 * t.batch * t.seq * m.ffn * 4
  assert working["block backward"]["output"] >= 4 * (t.batch * t.seq * m.hidden + 1)
  p = plan.make(cfg, working=working)
  assert p.compiled and p.device["layer executables (compiled)"] == max(
      w["temp"] + w["output"] for w in working.values())
  bigger = launch.compiled_memory(config.load(CONFIGS / "tiny.yaml", ["train.batch=16"]))
  assert bigger["block backward"]["temp"] > working["block backward"]["temp"]


def test_a_child_process_compiles_the_same_executables():
  cfg = config.load(CONFIGS / "tiny.yaml", ["engine.device_state_layers=0"])
  assert launch.compiled_memory_apart(cfg) == launch.compiled_memory(cfg)


def test_the_pinned_pool_is_capped_for_the_plan_of_the_compiled_executables(monkeypatch):
  """Before the backend starts, a placement that keeps groups on the host caps the pinned pool for
  the plan made with the executables' device bytes compiled in a child process, not the formula's
  estimate: the 14.77B shape on the H200's memories, where XLA's analysis (8.03 GiB) lets one more
  group into device memory and the host take a deeper gradient queue."""
  GiB = 2**30
  host = int(125.8 * GiB)
  compiled = {"head": {"argument": 0, "output": 0, "temp": int(8.03 * GiB), "alias": 0}}
  asked = []
  monkeypatch.setattr(launch, "backend_started", lambda: False)
  monkeypatch.setattr(launch, "probe_device_memory", lambda: 143771 * 2**20)
  monkeypatch.setattr(launch, "probe_device_count", lambda: 1)
  monkeypatch.setattr(launch, "compiled_memory_apart", lambda c, n: asked.append(n) or compiled)
  monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")
  monkeypatch.delenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", raising=False)
  cfg = config.load(CONFIGS / "qwen2.5_14b.yaml")
  with pytest.raises(plan.PlanError, match="host memory"):  # this CPU then runs it all on the host
    launch.plan_run(cfg, host_limit=host)
  limit = int(143771 * 2**20 * 0.92)
  one = lambda c: dataclasses.replace(c, engine=dataclasses.replace(c.engine, devices=1))
  estimated, exact = (plan.make(one(cfg), host, limit, plan.Rates(), w) for w in (None, compiled))
  assert asked == [1] and exact.device_state_layers > estimated.device_state_layers
  assert exact.grad_queue > estimated.grad_queue
  cap = int(os.environ["XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"]) * GiB
  assert cap == plan.memory.pinned_pool_bytes(exact.pinned) > plan.memory.pinned_pool_bytes(
      estimated.pinned)


def test_peak_rss_during_init_stays_near_the_state(tmp_path):
  # One 16-block model of ~29M params (350 MB of state); init may add a few layers on top.
  script = textwrap.dedent("""
      import resource, jax, numpy as np
      from mtjax import config, store
      jax.numpy.zeros(1).block_until_ready()
      m = config.ModelConfig(vocab_size=512, hidden=384, layers=16, heads=6, ffn=1024)
      cfg = config.Config(model=m, engine=config.EngineConfig(device_state_layers=0, device_update_layers=0))
      base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
      st = store.create(cfg, jax.random.key(0))
      peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
      layer = 12 * max(g.size for g in st.groups)
      a = st.allocated_bytes()
      print(peak - base, a["host"] + a["pinned"], layer)
  """)
  out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
  grown, state_bytes, layer = map(int, out.stdout.split())
  assert grown <= state_bytes + 4 * layer, (grown, state_bytes, layer)


def test_train_does_not_start_the_backend_before_the_launch_sets_it_up():
  # The pinned pool and the GPU memory fraction are read once, when the backend starts: a
  # train-side check that started it first silently left the GPU at XLA's default 75%.
  script = textwrap.dedent("""
      from mtjax import config, launch, train
      seen = []
      real = launch.plan_run
      def spy(cfg, *a, **k):
          seen.append(launch.backend_started())
          return real(cfg, *a, **k)
      launch.plan_run = spy
      train.run(config.load("configs/tiny.yaml", ["train.steps=1", "train.tensorboard=false",
                                                  "train.run_dir=RUN"]), progress=False)
      print(seen)
  """).replace("RUN", str(tmp_path_factory_dir()))
  out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       cwd=CONFIGS.parent, check=True)
  assert out.stdout.strip().splitlines()[-1] == "[False]", out.stdout + out.stderr


def tmp_path_factory_dir():
  import tempfile
  return tempfile.mkdtemp(prefix="mtjax-launch-")


def test_run_that_cannot_fit_is_refused_before_allocation(monkeypatch):
  cfg = config.load(CONFIGS / "llama_7b.yaml")
  monkeypatch.setattr(launch, "host_memory_limit", lambda: 64 * 2**30)
  monkeypatch.setattr(store_lib, "create", lambda *a, **k: pytest.fail("allocated before refusing"))
  with pytest.raises(plan.PlanError, match=r"host memory: needs \d+\.\d GiB .* limit 64\.0 GiB"):
    train.run(cfg, progress=False)
  # 13B: its weights and moments alone (12 B/param) exceed host and device memory together,
  # refused by byte arithmetic on the config before any layout or search
  with pytest.raises(plan.PlanError, match=r"host memory and device memory together: .* at least "
                                           r"1\d\d\.\d GiB .* 64\.0 GiB"):
    train.run(config.load(CONFIGS / "llama_13b.yaml"), progress=False)


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
    total += lay.fwd_s + lay.bwd_s + lay.saved_input_bytes / d2h  # kernels, saved input out
    if g < k:  # resident weights: only the moments come in
      total += 8 * lay.params / h2d + 8 * lay.params / d2h  # moments in and out
    else:
      back = 4 * lay.params if 0 < g < len(LAYERS) - 1 else 0  # embedding and head need none
      total += (4 * lay.params + back) / h2d + 4 * lay.params / d2h + lay.params / 500
    if 0 < g < len(LAYERS) - 1:
      total += lay.saved_input_bytes / h2d  # saved input back in for the backward
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
  out = sum((8 if g < k else 4) * lay.params + lay.saved_input_bytes for g, lay in enumerate(LAYERS))
  inward = sum(8 * lay.params if g < k else 4 * lay.params * (1 + (0 < g < len(LAYERS) - 1))
               for g, lay in enumerate(LAYERS)) + sum(lay.saved_input_bytes for lay in LAYERS)
  assert max(host, compute, out / in_out[1], inward / in_out[0]) <= step * (1 + 1e-9)
  assert step <= plan.simulate(LAYERS, k, rates, inflight, queue, overlap=False)


def test_planner_picks_device_updates_only_where_they_pay_and_fit():
  load = lambda *o: config.load(CONFIGS / "llama_3b.yaml", ["engine.device_state_layers=0", *o])
  cfg, auto = load("engine.device_update_layers=0"), load()
  G = cfg.model.layers + 2
  times = lambda rates: [plan.make(load(f"engine.device_update_layers={n}"), rates=rates).schedule_s
                         for n in range(G + 1)]
  # A device update sends m and v back (8 B/param) where the host path sends the gradient (4): with
  # a slow device->host link and a fast host optimizer, most groups stay on the host.
  slow_link = plan.Rates(h2d_gbps=1e4, d2h_gbps=5, host_adamw_in_step_gparams=1e3)
  k = plan.make(auto, rates=slow_link).device_update_layers
  t = times(slow_link)
  assert k < cfg.model.layers // 4 and t[k] == min(t)  # the fastest count
  slow_host = plan.Rates(host_adamw_in_step_gparams=0.5)
  assert plan.make(auto, rates=slow_host).device_update_layers > cfg.model.layers // 2
  room = plan.make(load("engine.device_update_layers=6")).device_total  # room for six, no more
  limit = int(room / (1 - plan.DEVICE_SPARE)) + 2**20  # an auto choice keeps DEVICE_SPARE free
  chosen = plan.make(auto, device_limit=limit, rates=slow_host)
  assert chosen.device_update_layers == 6 and chosen.fits_device
  # Pinned moments enlarge the pinned pool: a host limit just above the all-host plan keeps them off.
  tight = plan.make(cfg).host_total / (1 - plan.HOST_SPARE) + 2**30
  assert plan.make(auto, host_limit=int(tight), rates=slow_host).device_update_layers == 0


def test_state_goes_to_device_memory_when_it_fits_else_the_fastest_split():
  cfg = config.load(CONFIGS / "llama_9b.yaml")  # 9.2B: 110 GiB of state at 12 B/param
  G = cfg.model.layers + 2
  GiB = 2**30
  everything = plan.make(cfg, host_limit=200 * GiB, device_limit=140 * GiB)
  assert everything.tiers == ("device",) * G and everything.runner_up is not None
  tight = plan.make(cfg, host_limit=90 * GiB, device_limit=64 * GiB)
  k = tight.device_state_layers
  assert 0 < k < G and tight.fits_host and tight.fits_device
  assert tight.tiers[:k] == ("device",) * k  # the first groups: updated last, needed first
  fixed = lambda n, u: plan.make(config.load(CONFIGS / "llama_9b.yaml", [
      f"engine.device_state_layers={n}", f"engine.device_update_layers={u}"]),
                                 host_limit=90 * GiB, device_limit=64 * GiB)
  fewest = next(n for n in range(G) if fixed(n, 0).fits_host)
  assert k >= fewest and not fixed(fewest - 1, 0).fits_host
  assert tight.schedule_s <= fixed(fewest, 0).schedule_s  # moved further only where it pays
  with pytest.raises(plan.PlanError, match="host memory"):
    plan.check(plan.make(cfg, host_limit=20 * GiB, device_limit=40 * GiB))


def brute_force(cfg, host_limit, device_limit, rates=plan.Rates()):
  """Every (device, stream) pair planned; of those that fit both memories with the planner's
  spare, all-device if there, else the shortest simulated step (ties: more device groups)."""
  G = cfg.model.layers + 2
  fits = []
  for n_state in range(G + 1):
    for n_upd in range(G + 1 - n_state):
      p = plan.make(dataclasses.replace(cfg, engine=dataclasses.replace(
          cfg.engine, device_state_layers=n_state, device_update_layers=n_upd)),
          host_limit, device_limit, rates)
      if (p.fits_host and p.fits_device and p.fits_pool
          and p.device_total <= (1 - plan.DEVICE_SPARE) * device_limit
          and p.host_total <= (1 - plan.HOST_SPARE) * host_limit):
        fits.append(p)
  if any(p.device_state_layers == G for p in fits):
    return G, 0
  best = min(fits, key=lambda p: (p.schedule_s, -p.device_state_layers))
  return best.device_state_layers, best.device_update_layers


@pytest.mark.parametrize("host_gib,device_gib", [(40, 10), (32, 9), (24, 8)])
def test_the_placement_search_equals_brute_force_over_every_pair(host_gib, device_gib):
  """A 1B shape on memories too small for all of it on the device: the search (which stops
  counting up once device bytes no longer fit) finds what trying every pair finds."""
  GiB = 2**30
  cfg = config.load(CONFIGS / "llama_1b.yaml", ["optim.clip_norm=1.0"])
  got = plan.make(cfg, host_limit=host_gib * GiB, device_limit=device_gib * GiB)
  want = brute_force(cfg, host_gib * GiB, device_gib * GiB)
  assert (got.device_state_layers, got.device_update_layers) == want
  assert got.device_state_layers < cfg.model.layers + 2  # not everything fits the device


# The shapes shipped for one H200 with 1.5 TB of host RAM (configs/machines/h200_1.5tb.yaml).
BIG_BOX = ("dense_120b.yaml", "qwen3_235b_a22b.yaml", "qwen3_next_80b_a3b.yaml", "glm4.5_air.yaml",
           "llama4_scout.yaml")


def test_every_shipped_config_plans_for_the_h200_machine_file(tmp_path):
  """From this CPU machine: configs/machines/h200.yaml describes the GPU box; every shipped
  config (finetune.yaml needs a Hugging Face model, given by the tiny one's shape here) plans,
  the 1.5 TB box's on its own file."""
  machine = plan.Machine.load(CONFIGS / "machines" / "h200.yaml")
  for f in sorted(CONFIGS.glob("*.yaml")):
    if f.name in BIG_BOX:
      continue
    over = ["data.source=synthetic", "train.eval_every=0"] if f.name == "finetune.yaml" else []
    p = machine.plan(config.load(f, over))
    assert p.fits_host and p.fits_device and math.isfinite(p.schedule_s), f.name
    assert p.devices == 1 and p.device_limit == int(139.8 * 2**30 * plan.DEVICE_MEMORY_FRACTION)
  # small enough for the device: all of it there; a 14.8B shape: split, the host full
  small = machine.plan(config.load(CONFIGS / "llama_3b.yaml"))
  assert small.tiers == ("device",) * 30
  big = machine.plan(config.load(CONFIGS / "qwen2.5_14b.yaml"))
  assert 0 < big.device_state_layers < 50 and big.tiers.count("host") > 0
  # the CLI's --json carries the placement and both predictions
  out = tmp_path / "plan.json"
  assert plan_cli.main(["--config", str(CONFIGS / "qwen2.5_14b.yaml"), "--machine",
                    str(CONFIGS / "machines" / "h200.yaml"), "--json", str(out)]) == 0
  summary = json.loads(out.read_text())
  assert (summary["device_state_layers"], summary["device_update_layers"],
          summary["host_groups"]) == (big.device_state_layers, big.device_update_layers,
                                      big.tiers.count("host"))
  assert summary["schedule_s"] == pytest.approx(big.schedule_s) and summary["roofline_s"] > 0
  assert summary["devices"] == 1


def test_the_30b_class_fits_one_h200_box_at_int8_moments_and_not_at_fp32():
  """Qwen2.5-32B's and Qwen3-30B-A3B's shapes (about 200 GB of fp32 weights and 8-bit moments)
  over 141 GB of HBM and 125.8 GiB of host RAM: admitted, the state split between both; at fp32
  moments (12 B/param) refused, naming the 8-bit moments as what would fit."""
  machine = plan.Machine.load(CONFIGS / "machines" / "h200.yaml")
  for name in ("qwen2.5_32b.yaml", "qwen3_30b_a3b.yaml"):
    cfg = config.load(CONFIGS / name)
    assert cfg.optim.state_dtype == "int8"
    p = machine.plan(cfg)
    assert p.fits_host and p.fits_device and math.isfinite(p.schedule_s), name
    assert 0 < p.device_state_layers and p.tiers.count("host") > 0, name
    # the state of every group is counted once, in one memory or the other
    assert p.params == plan.count_params(cfg.model) > 30e9
    with pytest.raises(plan.PlanError, match="does not fit") as refused:
      plan.check(machine.plan(config.load(CONFIGS / name, ["optim.state_dtype=float32"])))
    assert "optim.state_dtype=int8" in str(refused.value) or "together" in str(refused.value)


def test_the_1_5tb_box_plans_the_100b_class_and_qwen3_235b():
  big = plan.Machine.load(CONFIGS / "machines" / "h200_1.5tb.yaml")
  small = plan.Machine.load(CONFIGS / "machines" / "h200.yaml")
  assert big.host_memory_gb == 1536 and big.rates() == dataclasses.replace(
      small, host_memory_gb=1536.0).rates()  # only the host memory differs
  for name, dtype, params in (("dense_120b.yaml", "float32", 120e9),
                              ("qwen3_235b_a22b.yaml", "int8", 230e9),
                              ("qwen3_next_80b_a3b.yaml", "float32", 79e9),
                              ("glm4.5_air.yaml", "float32", 106e9),
                              ("llama4_scout.yaml", "float32", 107e9)):
    cfg = config.load(CONFIGS / name)
    assert cfg.optim.state_dtype == dtype
    p = big.plan(cfg)
    assert p.fits_host and p.fits_device and math.isfinite(p.schedule_s), name
    assert p.params > params and p.tiers.count("host") > 0
    with pytest.raises(plan.PlanError, match="does not fit"):
      plan.check(small.plan(cfg))


def test_explicit_counts_win_and_a_bad_machine_file_is_one_line(tmp_path, capsys):
  machine = plan.Machine.load(CONFIGS / "machines" / "h200.yaml")
  p = machine.plan(config.load(CONFIGS / "llama_3b.yaml", ["engine.device_state_layers=3",
                                                           "engine.device_update_layers=5"]))
  assert (p.device_state_layers, p.device_update_layers) == (3, 5)
  bad = tmp_path / "m.yaml"
  bad.write_text("device_memory_gb: 80\ndevices: 0\nhost_memory_gb: 64\nmatmul_tflops: 1\n"
                 "h2d_gbps: 1\nd2h_gbps: 1\nhost_adamw_gparams: 1\nwarp: 9\n")
  assert plan_cli.main(["--config", str(CONFIGS / "tiny.yaml"), "--machine", str(bad)]) == 2
  err = capsys.readouterr().err.strip()
  assert "\n" not in err and "unknown keys ['warp']" in err


def test_a_placement_that_does_not_fit_is_refused_before_anything_is_allocated(monkeypatch):
  """Every group's state held on a device too small for it: refused by the plan, no store made."""
  monkeypatch.setattr(store_lib, "create", lambda *a, **k: pytest.fail("allocated"))
  cfg = config.load(CONFIGS / "tiny.yaml", ["engine.device_state_layers=4",
                                           "engine.device_memory_gb=0.000001"])
  with pytest.raises(plan.PlanError, match="device memory"):
    plan.check(plan.make(cfg, device_limit=1000, rates=plan.Rates()))
  with pytest.raises(SystemExit) as e:  # more groups than the model has: a config error
    train.main(["--config", str(CONFIGS / "tiny.yaml"), "--no-progress",
                "engine.device_state_layers=9"])
  assert e.value.code == 2


def test_placement_words_are_auto_or_counts():
  assert config.load(CONFIGS / "tiny.yaml", ["engine.device_update_layers=auto"]
                     ).engine.device_update_layers == "auto"
  with pytest.raises(config.ConfigError, match="engine.device_update_layers"):
    config.load(CONFIGS / "tiny.yaml", ["engine.device_update_layers=most"])
  with pytest.raises(config.ConfigError, match="exceed the 4 layer groups"):
    config.load(CONFIGS / "tiny.yaml", ["engine.device_update_layers=3", "engine.device_state_layers=2"])
  with pytest.raises(ValueError, match="resolve it with mtjax.launch.plan_run"):
    store_lib.create(config.load(CONFIGS / "tiny.yaml"), jax.random.key(0))


def test_grad_queue_auto_deepens_the_queue_only_where_the_host_optimizer_is_behind():
  GiB = 2**30
  limits = dict(host_limit=int(125.8 * GiB), device_limit=int(128.6 * GiB))
  big = plan.make(config.load(CONFIGS / "qwen2.5_14b.yaml"), **limits)
  at4 = plan.make(config.load(CONFIGS / "qwen2.5_14b.yaml", ["engine.grad_queue=4"]), **limits)
  assert big.grad_queue > 4 and big.schedule_s < 0.97 * at4.schedule_s
  assert big.host["gradients in flight"] > at4.host["gradients in flight"]  # paid in host bytes
  assert big.resolve(config.load(CONFIGS / "qwen2.5_14b.yaml")).engine.grad_queue == big.grad_queue
  # The runner-up is timed at the chosen queue too, so the two figures compare.
  n_dev, n_str, t = big.runner_up
  runner = plan.make(config.load(CONFIGS / "qwen2.5_14b.yaml", [
      f"engine.device_state_layers={n_dev}", f"engine.device_update_layers={n_str}",
      f"engine.grad_queue={big.grad_queue}"]), **limits)
  assert t == runner.schedule_s and t >= big.schedule_s
  # Where the host keeps up (batch 32 on the 3.37B shape), no deeper than needed.
  small = plan.make(config.load(CONFIGS / "llama_3b.yaml", ["engine.grad_queue=auto",
                                                            "train.batch=32"]), **limits)
  assert small.grad_queue <= 4


def test_activations_auto_spills_the_fewest_inputs_that_fit_both_memories():
  """Llama-3-8B at 256k tokens, 128 GiB of host and 110 GiB of device memory: spilling block
  inputs fills the host until the placement moves state to the device, so device bytes are not
  monotone in the spill count; the planner still finds the fewest spills that fit."""
  cfg = config.load(CONFIGS / "llama3_8b.yaml", ["train.seq=262144"])
  limits = dict(host_limit=128 * 2**30, device_limit=110 * 2**30)
  with_ = lambda **e: dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, **e))
  fits = lambda p: p.fits_host and p.fits_device and p.fits_pool
  spill = lambda k, n: plan.make(with_(activations_every=k, activations=n), **limits)
  assert not fits(spill(1, 32))  # all spilled: no fit
  chosen = plan.make(with_(activations_every=1), **limits)
  assert fits(chosen) and chosen.activations_on_host > 0
  assert not fits(spill(1, chosen.activations_on_host - 1))
  assert chosen.resolve(cfg).engine.activations == chosen.activations_on_host
  # both auto: no K's fewest fitting spill simulates a shorter step than the choice
  both = plan.make(cfg, **limits)
  assert fits(both)
  for k in plan.ACTIVATIONS_EVERY:
    first = next((p for p in (spill(k, n) for n in range(-(-32 // k) + 1)) if fits(p)), None)
    assert first is None or first.schedule_s >= both.schedule_s


def test_the_plan_counts_the_export_shard_beside_the_state():
  """An export gathers a shard (up to hf.MAX_SHARD_BYTES) in its dtype before writing it; the
  plan's host total carries that (the 1B fine-tune on the H200 peaked 8 GiB over a plan without it)."""
  from mtjax import hf
  base = config.load(CONFIGS / "llama_1b.yaml", ["engine.device_state_layers=0"])
  item = "import / export staging (start / end)"
  with_ = lambda *o: plan.make(config.load(CONFIGS / "llama_1b.yaml",
                                           ["engine.device_state_layers=0", *o]))
  plain = plan.make(base)
  assert plain.host[item] == 0
  n = plan.param_counts(base.model)["total"]
  for dtype, width in (("bfloat16", 2), ("float32", 4)):
    exp = with_("train.export_dir=/nonexistent/out", f"train.export_dtype={dtype}")
    assert exp.host[item] >= min(hf.MAX_SHARD_BYTES, width * n)  # the shard it holds
    assert exp.host_total - plain.host_total >= exp.host[item]  # the pool headroom is unchanged


def test_allocator_rounding_is_counted_per_saved_input_on_the_gpu_only():
  """The BFC allowance: a share of min(input, 128 MiB) for each saved block input held in GPU
  memory; none for inputs spilled to the host, none on the CPU backend."""
  GiB = 2**30
  limits = dict(host_limit=int(125.8 * GiB), device_limit=int(128.6 * GiB))
  over = ["train.batch=1", "train.seq=32768", "engine.micro_batch=null"]
  gpu = plan.make(config.load(CONFIGS / "llama_1b.yaml", over), **limits)
  per_input = min(32768 * 2048 * 2, 128 * 2**20)  # one bf16 [1, T, D] input, capped
  assert gpu.device["allocator rounding (measured)"] == int(
      plan.SAVED_INPUT_ROUNDING * per_input * 16)
  spilled = plan.make(config.load(CONFIGS / "llama_1b.yaml", over + ["engine.activations=4"]),
                      **limits)
  assert spilled.device["allocator rounding (measured)"] == int(
      plan.SAVED_INPUT_ROUNDING * per_input * 12)
  cpu = plan.make(config.load(CONFIGS / "llama_1b.yaml", over), **limits,
                  rates=plan.Rates(accelerator=False))
  assert cpu.device["allocator rounding (measured)"] == 0


def test_bfloat16_moments_let_the_gpt_oss_20b_shape_fit_the_h200_machine(capsys):
  """20.9B params: fp32 weights and moments (12 B/param, 234 GiB) exceed the box's 126 GiB host
  plus 129 GiB device with buffers; bfloat16 moments (8 B/param) fit, and the refusal says so."""
  machine = plan.Machine.load(CONFIGS / "machines" / "h200.yaml")
  fp32 = machine.plan(config.load(CONFIGS / "gpt_oss_20b.yaml", ["optim.state_dtype=float32"]))
  bf16 = machine.plan(config.load(CONFIGS / "gpt_oss_20b.yaml"))
  assert not fp32.fits_host and bf16.fits_host and bf16.fits_device
  assert bf16.host["optimizer state"] == pytest.approx(bf16.host["master weights"])
  with pytest.raises(plan.PlanError, match=r"optim.state_dtype=int8 \(or bfloat16\)"):
    plan.check(fp32)
  args = ["--config", str(CONFIGS / "gpt_oss_20b.yaml"), "--machine",
          str(CONFIGS / "machines" / "h200.yaml"), "optim.state_dtype=float32"]
  assert plan_cli.main(args) == exits.BAD_INPUT  # does not fit: refused, as train refuses it
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("refused: does not fit in host memory")


def test_the_attention_kernels_shares_are_the_measured_ones():
  """The planner's share of each attention kernel (plan.search.kernel_efficiency) against the
  rows measured side by side on one H100 (benchmarks/attention_kernels.py, its JSON kept in
  benchmarks/results/h100/attention/): each row's time predicted from the plain 128-wide cuDNN
  row by its causal FLOPs and the kernel's share. Within 20%: the model has one figure per kernel
  and head width; what it leaves out (the documents' cut of the blockwise kernel's blocks, the
  sequence length) moves the rows by up to 16%."""
  from mtjax.plan.search import kernel_efficiency
  rows = json.loads((Path(__file__).parent.parent / "benchmarks/results/h100/attention/"
                     "attention.json").read_text())
  ms = {(r["variant"], r["impl"]): r["ms"] for r in rows if r.get("ms")}
  ref = ms[("llama-8b", "cudnn")]
  flops = lambda r: r["B"] * r["N"] * r["H"] * r["T"] ** 2  # causal pairs x width, up to a factor
  base = next(r for r in rows if (r["variant"], r["impl"]) == ("llama-8b", "cudnn"))
  checked = 0
  for r in rows:
    if r.get("ms") is None or r["impl"] not in ("cudnn", "xla", "blockwise") or "window" in r:
      continue  # cuDNN's own packed layout is not used (wrong results); windows are not modelled
    kernel = "cudnn-mask" if r["impl"] == "cudnn" and "docs" in r else r["impl"]
    want = ref * flops(r) / flops(base) / kernel_efficiency(kernel, r["H"])
    assert r["ms"] == pytest.approx(want, rel=0.2), (r["variant"], r["impl"], r["ms"], want)
    checked += 1
  assert checked == 14  # every kernel the engine takes, on every variant but the window


def test_the_plan_costs_the_heads_chunks_and_the_devices_memory_bandwidth():
  """Each loss chunk passes once over the head's weights (plan.HEAD_CHUNK_BYTES per vocabulary
  entry and hidden unit): four times the chunks add three such passes to the compute; the
  memory-bound terms (the logits, the chunks, device updates) scale with 1 / the bandwidth."""
  rates = plan.Machine.load(CONFIGS / "machines" / "h200.yaml").rates()
  cfg = lambda chunk: config.load(CONFIGS / "llama3.2_1b.yaml", [f"engine.loss_chunk={chunk}"])
  compute = lambda c, r=rates: plan.make(c, rates=r).step_s["compute"]
  V, D = 128256, 2048  # 8 x 1024 tokens: 2 chunks of 4096, 8 of 1024
  assert compute(cfg(1024)) - compute(cfg(4096)) == pytest.approx(
      6 * plan.HEAD_CHUNK_BYTES * V * D / (rates.hbm_gbps * 1e9), rel=1e-9)
  assert plan.make(cfg(1024), rates=rates).schedule_s > plan.make(cfg(4096), rates=rates).schedule_s
  slow = dataclasses.replace(rates, hbm_gbps=rates.hbm_gbps / 2)
  p = plan.make(cfg(4096), rates=rates)
  memory_bound = (plan.HEAD_LOGIT_BYTES * V * 8192 + plan.HEAD_CHUNK_BYTES * V * D * 2
                  + plan.DEVICE_UPDATE_BYTES * p.params) / (rates.hbm_gbps * 1e9)
  assert compute(cfg(4096), slow) - compute(cfg(4096)) == pytest.approx(memory_bound, rel=1e-9)


def test_the_device_memory_bandwidth_is_measured_once_per_device():
  device = jax.devices()[0]
  launch._HBM_GBPS.pop(device, None)
  gbps = launch.device_memory_gbps(device, nbytes=4 * 2**20, repeats=3)
  assert math.isfinite(gbps) and gbps > 0
  assert launch.device_memory_gbps(device) == gbps  # cached: plan_run asks for it on every plan


def test_the_plan_costs_the_attention_kernel_each_layer_takes():
  """Packed documents (prepared data) cost cuDNN's kernel its mask; the blockwise kernel costs
  more; 256-wide heads run on cuDNN on Hopper, XLA's attention before it; a soft-cap takes the
  blockwise kernel (the shares: plan.search.kernel_efficiency)."""
  machine = plan.Machine.load(CONFIGS / "machines" / "h200.yaml")
  one_b = lambda *over: machine.plan(config.load(CONFIGS / "llama3.2_1b.yaml", list(over)))
  synthetic = one_b().schedule_s
  packed = one_b("data.source=prepared", "data.path=unused").schedule_s
  blockwise = one_b("data.source=prepared", "data.path=unused",
                    "engine.attention=blockwise").schedule_s
  assert synthetic < packed < blockwise
  assert plan.search.attention_kernels(
      config.load(CONFIGS / "llama3.2_1b.yaml", ["data.source=prepared", "data.path=unused"]),
      machine.rates()) == ["cudnn-mask"] * 16
  wide = config.load(CONFIGS / "tiny.yaml", ["model.heads=4", "model.kv_heads=2",
                                             "model.hidden=1024", "model.head_dim=256",
                                             "train.seq=2048", "engine.compute_dtype=bfloat16"])
  hopper = machine.rates()
  ampere = dataclasses.replace(hopper, compute_capability=8.0)
  assert plan.search.attention_kernels(wide, hopper)[0] == "cudnn"
  assert plan.search.attention_kernels(wide, ampere)[0] == "xla"
  assert (plan.make(wide, rates=ampere).schedule_s > plan.make(wide, rates=hopper).schedule_s)
  gemma2 = config.load(CONFIGS / "gemma2_9b.yaml")
  assert set(plan.search.attention_kernels(gemma2, hopper)) == {"blockwise"}


# Qwen2.5-14B's published config.json (Qwen/Qwen2.5-14B on the Hugging Face hub), its shape keys.
QWEN2_5_14B = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
               "hidden_size": 5120, "intermediate_size": 13824, "num_hidden_layers": 48,
               "num_attention_heads": 40, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
               "rope_theta": 1000000.0, "max_position_embeddings": 131072,
               "max_window_layers": 48, "sliding_window": 131072, "use_sliding_window": False,
               "tie_word_embeddings": False, "vocab_size": 152064}


def test_the_14b_config_is_qwen2_5_14b_as_the_qwen2_family_reads_it():
  """configs/qwen2.5_14b.yaml computes what the published Qwen2.5-14B does (the qwen2 family's
  reading of its config.json, q/k/v biases included), so the plan labels it qwen2 and an export
  writes Qwen2's config.json."""
  from mtjax.models import registry
  m = config.load(CONFIGS / "qwen2.5_14b.yaml").model
  assert m == config.ModelConfig(**registry.read_hf_config(QWEN2_5_14B))
  assert plan.param_counts(m)["total"] == pytest.approx(14.77e9, abs=0.005e9)
  assert plan.format_plan(plan.make(config.load(CONFIGS / "qwen2.5_14b.yaml"))).startswith("qwen2:")
  written = registry.get(m.family).write_config(m, "bfloat16")
  assert written["architectures"] == ["Qwen2ForCausalLM"] and written["attention_bias"] is True
  assert config.ModelConfig(**registry.read_hf_config(written)) == m


def test_the_size_refusal_names_the_models_true_parameter_count(monkeypatch):
  """Llama-3-8B (8,030,261,248 parameters, as published) on 16 GiB of host memory: refused by
  arithmetic before any layout, naming its real size."""
  monkeypatch.setattr(models, "spec", lambda *a: pytest.fail("laid out to refuse by size"))
  cfg = config.load(CONFIGS / "llama3_8b.yaml")
  with pytest.raises(plan.PlanError, match=r"\(8\.03B params x 12 B/param\)") as e:
    plan.make(cfg, host_limit=16 * 2**30)
  assert f"{8_030_261_248 * 12 / 2**30:,.1f} GiB" in str(e.value)


MOES = hst.one_of(hst.none(), hst.builds(
    config.MoEConfig, experts=hst.sampled_from([4, 8]), experts_per_token=hst.just(2),
    expert_ffn=hst.sampled_from([8, 24]), router_bias=hst.booleans(),
    score_correction_bias=hst.booleans(), shared_experts=hst.integers(0, 2),
    shared_ffn=hst.sampled_from([None, 16]), shared_gate=hst.booleans(),
    first_dense_layers=hst.integers(0, 2), dense_layers=hst.sampled_from([(), (2,), (1, 3)]),
    every=hst.integers(1, 2)))
MLAS = hst.one_of(hst.none(), hst.builds(config.MLAConfig, kv_lora_rank=hst.sampled_from([8, 16]),
                                         q_lora_rank=hst.sampled_from([None, 12])))


@given(layers=hst.integers(1, 5), heads=hst.sampled_from([2, 4]), kv=hst.sampled_from([1, 2]),
       head_dim=hst.sampled_from([None, 8]), flags=hst.fixed_dictionaries(
           {k: hst.booleans() for k in ("qkv_bias", "o_bias", "qk_norm", "attention_sinks",
                                        "mlp_bias", "tie_embeddings")}),
       scope=hst.sampled_from(["head", "all"]), norms=hst.sampled_from(["pre", "sandwich", "post"]),
       moe=MOES, mla=MLAS, gate=hst.booleans(), linear=hst.one_of(hst.none(), hst.builds(
           config.LinearAttentionConfig, key_heads=hst.sampled_from([1, 2]),
           value_heads=hst.just(2), conv_kernel=hst.sampled_from([2, 4]))))
@settings(max_examples=30)  # shapes only (no compile): cheap
def test_the_arithmetic_count_is_the_layouts(layers, heads, kv, head_dim, flags, scope, norms, moe,
                                             mla, gate, linear):
  """`plan.count_params` (arithmetic on the config, what the size refusal prints) against the
  parameters of the layouts the model is built from, over drawn options of every block part."""
  assume(moe is None or moe.first_dense_layers <= layers)
  gate = gate and mla is None and scope == "head"
  types = None if linear is None else tuple("linear" if i % 2 else "full" for i in range(layers))
  m = config.ModelConfig(vocab_size=64, hidden=32, layers=layers, heads=heads, kv_heads=kv,
                         head_dim=head_dim, ffn=40, qk_norm_scope=scope, norm_position=norms,
                         moe=moe, mla=mla, attn_output_gate=gate, linear=linear,
                         layer_types=types, **flags)
  assert plan.count_params(m) == plan.param_counts(m)["total"]


def test_the_arithmetic_count_is_the_layouts_for_every_shipped_shape():
  for f in sorted(CONFIGS.glob("*.yaml")):
    over = ["data.source=synthetic", "train.eval_every=0"] if f.name == "finetune.yaml" else []
    m = config.load(f, over).model
    assert plan.count_params(m) == plan.param_counts(m)["total"], f.name
  for tower, projector, tokens in [("clip", "mlp", None), ("siglip", "pool", 144),
                                   ("siglip", "mlp", None), ("clip", "pool", 36)]:
    m = config.load(CONFIGS / "llava_7b.yaml", [
        f"model.vision.tower={tower}", f"model.vision.projector={projector}",
        f"model.vision.tokens_per_image={tokens or 'null'}",
        "model.vision.projector_bias=false"]).model
    assert plan.count_params(m) == plan.param_counts(m)["total"], (tower, projector)
  for tower, window in [("qwen2_5_vl", 112), ("qwen2_vl", None)]:  # Qwen-VL's towers and merger
    m = config.load(CONFIGS / "llava_7b.yaml", [
        f"model.vision.tower={tower}", "model.vision.projector=merger",
        f"model.vision.window={window or 'null'}", "model.vision.act=silu",
        f"model.vision.full_blocks=[{'3' if window else ''}]"]).model
    assert plan.count_params(m) == plan.param_counts(m)["total"], tower
  m = config.load(CONFIGS / "llava_7b.yaml", [  # Qwen3-VL's: learned positions, deepstack mergers
      "model.vision.tower=qwen3_vl", "model.vision.projector=merger", "model.vision.act=gelu_tanh",
      "model.vision.positions=2304", "model.vision.deepstack=[4,8,16]"]).model
  assert plan.count_params(m) == plan.param_counts(m)["total"], "qwen3_vl"


def test_the_plan_counts_the_checkpoints_a_run_writes_and_shows_only_the_files_it_writes(tmp_path):
  """A run saves every train.checkpoint_every steps and at its last step, once where they meet:
  with every save kept (train.keep_checkpoints=0) the plan's count is the folders the run leaves.
  The plan shows a checkpoint line only with train.checkpoint_dir, an export line only with
  train.export_dir."""
  tiny = lambda *o: config.load(CONFIGS / "tiny.yaml", ["train.tensorboard=false", *o])
  for steps, every in ((6, 2), (5, 2)):  # saves at 2, 4, 6; at 2, 4, 5
    ck = tmp_path / f"ck_{steps}"
    cfg = tiny(f"train.steps={steps}", f"train.checkpoint_every={every}",
               "train.keep_checkpoints=0", f"train.checkpoint_dir={ck}",
               f"train.run_dir={tmp_path / 'runs'}")
    train.run(cfg, progress=False)
    written = len(list(ck.glob("step_*")))
    assert written == 3 and plan.make(cfg).disk["checkpoints at once"] == written
  # steps=30, checkpoint_every=10, keep 3: the saves are 10, 20 and 30, so at most 3 on disk
  kept = plan.make(tiny("train.steps=30", "train.checkpoint_every=10", "train.keep_checkpoints=3",
                        f"train.checkpoint_dir={tmp_path / 'ck'}"))
  assert kept.disk["checkpoints at once"] == 3
  assert kept.disk["checkpoints kept"] == 3 * kept.disk["one checkpoint"]
  lines = lambda p: [ln for ln in plan.format_plan(p).splitlines() if "disk" in ln]
  assert [ln.split(":")[0] for ln in lines(kept)] == ["checkpoint disk"]
  neither = plan.make(tiny())
  assert neither.disk == {} and lines(neither) == []
  export = plan.make(tiny(f"train.export_dir={tmp_path / 'out'}"))
  assert set(export.disk) == {"export"} and [ln.split(":")[0] for ln in lines(export)] == [
      "export disk"]


def test_the_plans_tables_keep_one_column_past_their_longest_label():
  """Every byte item's figure in one column, whatever its label: the H200 plan of the 3.37B shape
  (all in device memory: "weights and optimizer state (device tier)", the longest label the plan
  prints) and a CPU plan (its host-RAM device line)."""
  on_h200 = plan.Machine.load(CONFIGS / "machines" / "h200.yaml").plan(
      config.load(CONFIGS / "llama_3b.yaml"))
  on_cpu = plan.make(config.load(CONFIGS / "tiny.yaml"), rates=plan.Rates(accelerator=False))
  longest = max(len(k) for p in (on_h200, on_cpu) for k in [*p.host, *p.device])
  for p in (on_h200, on_cpu):
    items = [(k, v) for table in (p.host, p.device) for k, v in table.items() if v]
    lines = [ln for ln in plan.format_plan(p).splitlines() if ln.startswith("  ")]
    assert len({len(ln) for ln in lines}) == 1, lines  # the figures end in one column
    for (k, v), ln in zip(items, lines, strict=True):
      assert ln[2:].startswith(k + " ") and ln.endswith(f" {v / 2**30:.2f} GiB")
  assert "weights and optimizer state (device tier)" in plan.format_plan(on_h200)
  assert longest == len("weights and optimizer state (device tier)")


def test_plan_refuses_a_run_that_does_not_fit_with_bad_input_as_train_does(tmp_path, capsys):
  """"Does not fit" exits BAD_INPUT (2) from `plan` as from `train`, one line on stderr: refused by
  size (the default path, as `train` refuses it), and refused after the plan is printed (a
  machine file whose memories the 1B shape's plan exceeds)."""
  run = lambda module, *a: subprocess.run([sys.executable, "-m", module, "--config",
                                           str(CONFIGS / "tiny.yaml"), *a],
                                          capture_output=True, text=True)
  for r in (run("mtjax.plan", "model.layers=2000000"), run("mtjax.train", "model.layers=2000000")):
    assert r.returncode == exits.BAD_INPUT, r.stderr
    assert r.stderr.startswith("refused: does not fit in host memory") and r.stderr.count("\n") == 1
  machine = tmp_path / "small.yaml"
  machine.write_text("device_memory_gb: 1\ndevices: 1\nhost_memory_gb: 12\nmatmul_tflops: 100\n"
                     "h2d_gbps: 10\nd2h_gbps: 10\nhost_adamw_gparams: 1\n")
  out = tmp_path / "plan.json"
  assert plan_cli.main(["--config", str(CONFIGS / "llama_1b.yaml"), "--machine", str(machine),
                    "--json", str(out)]) == exits.BAD_INPUT
  printed = capsys.readouterr()
  assert "(DOES NOT FIT)" in printed.out and not json.loads(out.read_text())["fits"]
  err = printed.err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("refused: does not fit in host memory")


PURE_PLAN = """
import os, subprocess
from jax._src import xla_bridge
env = dict(os.environ)
def refuse(*a, **k):
  raise AssertionError(f"the planner started a process: {a}")
subprocess.Popen = refuse
from mtjax import config, plan
GiB = 2**30
p = plan.make(config.load("configs/qwen2.5_14b.yaml"), host_limit=126 * GiB,
              device_limit=128 * GiB, working={"head": {"temp": GiB, "output": 0}})
m = plan.Machine.load("configs/machines/h200.yaml").plan(config.load("configs/llama3_8b.yaml"))
plan.format_plan(p), plan.plan_summary(m)
assert dict(os.environ) == env, "the planner wrote the environment"
assert not xla_bridge._backends, "the planner started the jax backend"
print("pure")
"""


def test_the_planner_takes_the_machines_facts_as_arguments_and_touches_nothing():
  """mtjax.plan makes, prints and summarises plans (the search, the simulation, a machine file's
  plan) without writing the environment, starting a process or the jax backend; its modules (the
  CLI aside, a command) import nothing that could: probing the machine is mtjax.launch's."""
  out = subprocess.run([sys.executable, "-c", PURE_PLAN], capture_output=True, text=True,
                       cwd=CONFIGS.parent)
  assert out.returncode == 0 and out.stdout.strip() == "pure", out.stderr
  import ast
  for path in sorted((CONFIGS.parent / "mtjax" / "plan").glob("*.py")):
    if path.name == "__main__.py":
      continue
    tree = ast.parse(path.read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    for n in ast.walk(tree):
      if isinstance(n, ast.ImportFrom) and n.module:
        imported |= {n.module} | {f"{n.module}.{a.name}" for a in n.names}
    roots = {name.split(".")[0] for name in imported}
    assert not roots & {"os", "subprocess", "sys", "jax"} and "mtjax.launch" not in imported, (
        path.name, sorted(imported))
    assert not any(isinstance(n, ast.Name) and n.id == "open" for n in ast.walk(tree)), path.name


def test_the_planners_measured_constants_are_the_ones_docs_performance_shows():
  """The figures behind the planner's constants live in docs/performance.md; every constant its
  table names exists, and the attention kernels' shares there are the code's."""
  import re
  from mtjax.plan import memory, schedule, search
  text = (CONFIGS.parent / "docs" / "performance.md").read_text()
  section = text.split("## The planner's constants\n")[1].split("\n## ")[0]
  names = re.findall(r"^\| `([A-Z_]+|Rates\.\w+)`", section, re.M)
  assert len(names) >= 8
  for name in names:
    owner, _, attr = name.rpartition(".")
    assert any(hasattr(schedule.Rates if owner else mod, attr or name)
               for mod in (memory, schedule, search)), name
  shares = dict(re.findall(r"\(`(\w+_SHARE)`\) \| ([0-9.]+) \|", section))
  assert shares == {"WIDE_SHARE": str(search.WIDE_SHARE), "MASK_SHARE": f"{search.MASK_SHARE:.2f}"}
  assert f"width / {search.BLOCKWISE_WIDTH}, at most {search.BLOCKWISE_MAX_SHARE}" in section
  assert f"width / {search.XLA_WIDTH}" in section


def test_plan_help_points_to_the_config_reference(capsys):
  from mtjax.plan import __main__ as plan_cli
  with pytest.raises(SystemExit) as e:
    plan_cli.main(["--help"])
  text = " ".join(capsys.readouterr().out.split())
  assert e.value.code == 0 and "docs/config.md" in text and "(default: None)" in text


def test_the_fused_updates_cost_follows_the_moments_storage():
  """The plan costs the host loop and the device update at the state dtype's measured share
  (plan.schedule.STATE_COSTS): the same placement's host-optimizer term is float32's over the
  share, and the table in docs/performance.md holds the code's figures."""
  from mtjax.plan import schedule
  terms = {}
  for sd in ("float32", "bfloat16", "int8"):
    cfg = config.load(CONFIGS / "qwen2.5_14b.yaml", [
        f"optim.state_dtype={sd}", "engine.device_state_layers=2", "engine.device_update_layers=33"])
    terms[sd] = plan.make(cfg, rates=plan.Rates()).step_s["host optimizer"]
  for sd in ("bfloat16", "int8"):
    assert terms[sd] == pytest.approx(terms["float32"] / schedule.STATE_COSTS[sd][0], rel=1e-9)
  text = (CONFIGS.parent / "docs" / "performance.md").read_text()
  host = ", ".join(f"{k} {v[0]}" for k, v in schedule.STATE_COSTS.items())
  assert f"host share {host}" in text
  assert f"x{schedule.STATE_COSTS['int8'][1]}" in text
  with pytest.raises(ValueError, match="already for int8"):
    plan.Rates().for_state("int8").for_state("int8")


@pytest.mark.parametrize("freeze", [("vision",), ("vision", "projector"), ("projector",),
                                    ("language",)])
def test_frozen_parts_hold_no_optimizer_state_and_send_no_gradient(freeze):
  """train.freeze in the plan, every group on the host: the optimizer state, the host update and
  the gradients out are the trained groups' alone, and the step predicted shorter."""
  over = ["model.vision.layers=2", "model.vision.image_token_id=5",
          "engine.device_state_layers=0", "engine.device_update_layers=0"]
  base = config.load(CONFIGS / "tiny.yaml", over)
  frozen = config.load(CONFIGS / "tiny.yaml", over + [f"train.freeze=[{','.join(freeze)}]"])
  spec = models.spec(base.model)
  trained = sum(spec.counts[k] for _, k in spec.groups if spec.part(k) not in freeze)
  everything = spec.counts["total"]
  a, b = plan.make(base, 2**36), plan.make(frozen, 2**36)
  assert a.host["optimizer state"] == base.optim.moment_bytes * everything
  assert b.host["optimizer state"] == base.optim.moment_bytes * trained
  assert b.step_s["host optimizer"] == pytest.approx(a.step_s["host optimizer"] * trained
                                                     / everything)
  assert b.step_s["device->host"] == pytest.approx(a.step_s["device->host"] * trained
                                                   / everything)
  assert b.schedule_s < a.schedule_s
