"""DPO (train.objective=dpo): the engine's pair loss and gradients against the formula written in
plain JAX over the whole-model reference, the stored reference log-probs, and the CLI's checks."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import reference as ref
from numerics import assert_close
from test_engine import make_cfg, new_engine
from mtjax import config, dpo, runlog, train

TINY = Path(__file__).parent.parent / "configs" / "tiny.yaml"


def make_pairs(n, seq, vocab, seed=0, pad=0):
  """n pairs sharing a prompt of 2-4 tokens, responses of 1 to the rest, padded with `pad`."""
  rng = np.random.default_rng(seed)
  S = seq + 1
  arrays = {k: np.zeros((n, S), np.int32) for k in ("chosen", "rejected")}
  masks = {k: np.zeros((n, S), np.uint8) for k in ("chosen", "rejected")}
  for i in range(n):
    p = rng.integers(2, 5)
    prompt = rng.integers(1, vocab, p)
    for k in arrays:
      r = rng.integers(1, S - p + 1)
      arrays[k][i, :p] = prompt
      arrays[k][i, p:p + r] = rng.integers(1, vocab, r)
      arrays[k][i, p + r:] = pad
      masks[k][i, p:p + r] = 1
  return dpo.Pairs(arrays["chosen"], masks["chosen"], arrays["rejected"], masks["rejected"])


def reference_loss(params, b, cfg):
  """The DPO formula on the reference model: row log-probs summed over the response mask."""
  d = cfg.train.dpo
  pol = jnp.sum(ref.token_logps(params, b.inputs, b.targets, cfg.model) * b.loss_weights, axis=1)
  pc, pr = pol[0::2], pol[1::2]
  rc, rr = b.ref_logps[0::2], b.ref_logps[1::2]
  h = (pc - rc) - (pr - rr)
  pair = -jax.nn.log_sigmoid(d.beta * h) if d.loss == "sigmoid" else (h - 1 / (2 * d.beta)) ** 2
  loss = jnp.mean(pair)
  if d.sft_weight:
    nll = -ref.token_logps(params, b.inputs, b.targets, cfg.model)[0::2]
    loss = loss + d.sft_weight * jnp.sum(nll * b.loss_weights[0::2]) / jnp.sum(b.loss_weights[0::2])
  return loss


def dpo_cfg(dpo_=None, model=None, engine_=None, train=None, data=None):
  """test_engine's tiny config with the dpo objective (on pairs in `data`, a folder)."""
  raw = config.to_dict(make_cfg(model, engine_))
  raw["train"].update(objective="dpo", dpo=dpo_ or {}, **(train or {}))
  raw["data"] = {"source": "prepared", "path": str(data or "pairs")}
  return config.from_dict(raw)


@pytest.mark.parametrize("variant", [
    dict(dpo_=dict(loss="sigmoid", beta=0.5)),
    dict(dpo_=dict(loss="ipo", beta=0.5)),
    dict(dpo_=dict(loss="sigmoid", beta=0.5, sft_weight=0.7), model=dict(tie_embeddings=True),
         engine_=dict(loss_chunk=5, device_update_layers=2), train=dict(batch=8, grad_accum=2)),
    dict(dpo_=dict(loss="ipo", beta=2.0, sft_weight=0.3), engine_=dict(device_state_layers=4)),
], ids=["sigmoid", "ipo", "sigmoid-sft-tied-accum", "ipo-sft-device"])
def test_dpo_loss_and_gradients_equal_the_formula_on_the_reference_model(variant):
  cfg = dpo_cfg(**variant)
  st, eng = new_engine(cfg)
  pairs = make_pairs(cfg.train.batch // 2, cfg.train.seq, cfg.model.vocab_size)
  rng = np.random.default_rng(1)
  ref_logps = rng.normal(-20.0, 3.0, 2 * len(pairs)).astype(np.float32)  # a reference not the policy
  b = pairs.batch(0, len(pairs), ref_logps)
  loss, grads = eng.grads(b)
  want_loss, want_tree = jax.value_and_grad(reference_loss)(st.to_tree(), b, cfg)
  assert_close(loss, float(want_loss), name="loss")
  for g, r, grp in zip(grads, ref.flat_grads(st, want_tree), st.groups):
    assert_close(g, r, name=grp.name)
  eng.close()


def test_reference_logps_are_a_forward_of_the_initial_weights_and_recomputed_on_change(tmp_path):
  cfg = dpo_cfg(data=tmp_path)
  pairs = make_pairs(5, cfg.train.seq, cfg.model.vocab_size)  # 5 pairs: batches of 2, the last short
  st, eng = new_engine(cfg)
  src, computed = dpo.training_source(cfg, eng, pairs)
  assert computed and (tmp_path / dpo.REF_FILE).exists()
  whole = pairs.batch(0, len(pairs))
  want = jnp.sum(ref.token_logps(st.to_tree(), whole.inputs, whole.targets, cfg.model)
                 * whole.loss_weights, axis=1)
  assert_close(src.ref, want, name="reference log-probs")
  assert_close(src.batch(1).ref_logps, np.asarray(want).reshape(-1, 2)[[2, 3]].reshape(-1))
  # the same model and data: read back, not recomputed
  again, computed = dpo.training_source(cfg, eng, pairs)
  assert not computed and np.array_equal(again.ref, src.ref)
  # the data changes: recomputed
  changed = dpo.Pairs(pairs.chosen.copy(), pairs.chosen_mask, pairs.rejected, pairs.rejected_mask)
  changed.chosen[0, -1] = (changed.chosen[0, -1] + 1) % cfg.model.vocab_size
  _, computed = dpo.training_source(cfg, eng, changed)
  assert computed
  eng.close()
  # the model changes (another init seed): recomputed, and different
  other = dpo_cfg(data=tmp_path, train=dict(seed=3))
  st2, eng2 = new_engine(other, seed=3)
  src2, computed = dpo.training_source(other, eng2, pairs)
  assert computed and not np.allclose(src2.ref, src.ref)
  eng2.close()


def write_pairs(folder, pairs):
  folder.mkdir(parents=True, exist_ok=True)
  for name in ("chosen", "chosen_mask", "rejected", "rejected_mask"):
    np.save(folder / f"{name}.npy", getattr(pairs, name))


def test_a_dpo_run_logs_rewards_and_its_margin_grows(tmp_path):
  data = tmp_path / "pairs"
  write_pairs(data, make_pairs(8, 64, 256, seed=2))
  run = tmp_path / "run"
  cfg = config.load(TINY, ["train.objective=dpo", "train.steps=6", "train.batch=8",
                                     "train.grad_accum=2", "train.dpo.beta=0.5",
                                     "data.source=prepared", f"data.path={data}",
                                     f"train.run_dir={run}", "train.tensorboard=false"])
  s = train.run(cfg, progress=False)
  records = runlog.read_metrics(run)
  assert len(records) == 6
  for r in records:
    assert {"reward_accuracy", "reward_chosen", "reward_rejected", "reward_margin"} <= set(r)
    assert r["reward_margin"] == pytest.approx(r["reward_chosen"] - r["reward_rejected"], abs=1e-5)
  # at the initial weights the policy is the reference: every reward 0, the loss log 2
  assert records[0]["reward_margin"] == pytest.approx(0.0, abs=1e-5)
  assert s["first_loss"] == pytest.approx(np.log(2.0), rel=1e-5)
  assert records[-1]["reward_margin"] > 0 and s["final_loss"] < s["first_loss"]
  assert json.loads((data / dpo.REF_KEY_FILE).read_text())["rows"] == 16


@pytest.mark.parametrize("override, message", [
    (["train.objective=dpo"], "train.objective: dpo needs preference pairs"),
    (["train.objective=dpo", "data.source=prepared", "data.path=MISSING"],
     "missing chosen.npy, chosen_mask.npy, rejected.npy, rejected_mask.npy"),
    (["train.objective=dpo", "train.batch=6", "train.grad_accum=2"],
     "each pass's train.batch / train.grad_accum (6 / 2) sequences must be even"),
    (["train.objective=dpo", "train.dpo.beta=0"], "train.dpo: beta (0.0) must be > 0"),
])
def test_bad_dpo_config_is_one_line_and_exit_2(override, message, tmp_path, capsys):
  override = [o.replace("MISSING", str(tmp_path / "none")) for o in override]
  argv = ["--no-progress", "--config", str(TINY), "train.steps=1", f"train.run_dir={tmp_path}",
          *override]
  try:
    code = train.main(argv)
  except SystemExit as e:  # the CLI's config parsing exits
    code = e.code
  err = capsys.readouterr().err.strip().splitlines()
  assert code == 2 and len(err) == 1 and message in err[0], err


def test_dpo_trains_on_pairs_prepared_from_a_preference_file(tmp_path, caplog):
  """`prepare --format preference` to a DPO run: each side's ids and answer mask are the prepared
  pair's (transformers' rendering, tests/test_formats.py), cut at train.seq + 1 and padded with the
  pad id; a pair whose answer the cut leaves empty is refused in one line."""
  from test_chat import CHATML_TAGGED, make_tokenizer
  from mtjax import data
  tok = make_tokenizer(tmp_path / "tok", CHATML_TAGGED)
  rows = [{"prompt": f"What is {a} and {b}?", "chosen": f"{a + b}.",
           "rejected": "I do not know, sorry." * (1 + i % 3)}
          for i, (a, b) in enumerate([(12, 30), (7, 8), (100, 1), (3, 4), (21, 21), (9, 90)])]
  (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  out = tmp_path / "pairs"
  data.prepare(tok, out, [str(tmp_path / "p.jsonl")], "preference", progress=False,
               val_fraction=0)
  prepared = data.read_pairs(out)
  longest = max(len(prepared.pair(i)[2]) for i in range(len(prepared)))
  seq = longest - 4  # the longest rejected answers are cut, none loses every token
  with caplog.at_level("WARNING", logger="mtjax.dpo"):
    pairs = dpo.load_pairs(out, seq, 320)
  assert len(pairs) == len(rows) and pairs.seq == seq
  cut = 0
  for i in range(len(rows)):
    sides = prepared.pair(i)
    for name, ids, mask in (("chosen", *sides[:2]), ("rejected", *sides[2:])):
      k = min(len(ids), seq + 1)
      cut += len(ids) > seq + 1
      np.testing.assert_array_equal(getattr(pairs, name)[i, :k], ids[:k])
      np.testing.assert_array_equal(getattr(pairs, name + "_mask")[i, :k], mask[:k])
      assert np.all(getattr(pairs, name)[i, k:] == prepared.pad_id)
      assert not getattr(pairs, name + "_mask")[i, k:].any()
  assert cut and f"{cut} of {len(rows)} pairs are longer" in caplog.text
  prompt = int(prepared.prefix.max())
  with pytest.raises(ValueError, match=r"preference pair \d+: its chosen answer has no token"):
    dpo.load_pairs(out, prompt - 1, 320)

  run = tmp_path / "run"
  cfg = config.load(TINY, ["train.objective=dpo", "train.steps=3", "train.batch=4",
                           f"train.seq={seq}", "model.vocab_size=320", "data.source=prepared",
                           f"data.path={out}", f"train.run_dir={run}", "train.tensorboard=false"])
  s = train.run(cfg, progress=False)
  assert s["first_loss"] == pytest.approx(np.log(2.0), rel=1e-5)  # the policy is the reference
  assert len(runlog.read_metrics(run)) == 3
