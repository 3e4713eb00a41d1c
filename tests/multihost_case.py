"""One process of a two-host run on the CPU, started twice by tests/test_devices.py:

  python tests/multihost_case.py PROCESS_ID PORT

Two processes with two simulated CPU devices each, joined by `jax.distributed.initialize` (gloo
collectives): a mesh of 4 devices over 2 hosts. Each process holds only its groups' state and
updates it; the weights of every group reach every device from their owner. Gradients and three
clipped AdamW steps are held to the plain reference (jax.grad + optax) in each process; each checks
the groups it owns. Prints "ok" and exits 0 when all agree.
"""

import os
import sys
from pathlib import Path

pid, port = int(sys.argv[1]), sys.argv[2]
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=pid)
sys.path.insert(0, str(Path(__file__).parent))


import reference as ref
from numerics import assert_close, assert_trees_close
from mtjax import engine, store as store_lib
from test_engine import batch_for, make_cfg, ref_loss_and_grads, reference_training

cfg = make_cfg({"layers": 4}, dict(devices=2, device_state_layers=2, device_update_layers=1),
               optim=dict(clip_norm=0.05), train=dict(batch=4))
st = store_lib.create(cfg, jax.random.key(0))
assert st.multiprocess and len(st.devices) == 4
mine = [i for i, g in enumerate(st.groups) if st.owns(i)]
assert 0 < len(mine) < len(st.groups), mine  # the state is split between the hosts
# The reference's initial weights: the same init, all groups, in this process alone.
full = store_lib.create(cfg, jax.random.key(0), mesh=store_lib.single_device_mesh(jax.local_devices()[0]))
params = full.to_tree()
eng = engine.Engine(cfg, st)

b = batch_for(cfg)
loss, grads = eng.grads(b)
ref_loss, ref_tree = ref_loss_and_grads(cfg, params, b)
assert_close(loss, float(ref_loss), name="loss")
for g, r, grp in zip(grads, ref.flat_grads(full, ref_tree), st.groups):
  assert_close(g, r, name=grp.name)

batches = [batch_for(cfg, i) for i in range(3)]
want, _, want_losses = reference_training(cfg, params, batches)
losses = [eng.step(x).loss for x in batches]
eng.sync()
assert_close(losses, want_losses, name="losses")
want_parts = [want["embed"], *want["blocks"], want["head"]]
for i in mine:
  # Adam's per-coordinate steps of O(lr) can flip on a gradient that cancels to rounding level
  # (see test_engine.test_k_streamed_steps_equal_plain_optax): 1e-3 * lr per element allowed.
  assert_trees_close(st.groups[i].layout.unflatten(st.read(i)["w"]), want_parts[i],
                     atol=1e-3 * cfg.optim.lr, name=st.groups[i].name)
eng.close()
print(f"ok: process {pid} owns groups {mine}", flush=True)
