"""A machine to plan for, described by a YAML file: plans for a box one does not have."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from mtjax import config as config_lib
from mtjax.plan.memory import DEVICE_MEMORY_FRACTION, GiB
from mtjax.plan.schedule import Rates
from mtjax.plan.search import Plan, PlanError, devices_of, make, with_devices

@dataclasses.dataclass(frozen=True)
class Machine:
  """A machine to plan for, from a YAML file (configs/machines/h200.yaml): its memories, device
  count and rates; no accelerator needed where the plan is made."""
  device_memory_gb: float  # each device's memory; a run may use DEVICE_MEMORY_FRACTION of it
  devices: int  # devices the step runs on
  host_memory_gb: float  # host RAM the process may use
  matmul_tflops: float  # bf16 dense matmul rate
  h2d_gbps: float  # pinned host -> device
  d2h_gbps: float  # device -> pinned host
  host_adamw_gparams: float  # the host AdamW inside a training step
  attention_tflops: float = 470.0  # fused causal attention, forward and backward
  hbm_gbps: float = 4300.0  # device memory bandwidth
  compute_capability: float = 9.0  # the GPU's (Hopper: 9.0): which attention kernels apply

  @classmethod
  def load(cls, path: str | Path) -> "Machine":
    """Reads and checks a machine file; ConfigError (one line) on anything wrong."""
    import yaml
    try:
      raw = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
      raise config_lib.ConfigError(f"--machine: cannot read {path} ({type(e).__name__})") from None
    if not isinstance(raw, dict):
      raise config_lib.ConfigError(f"--machine: {path} must hold a mapping")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - names)
    missing = sorted(f.name for f in dataclasses.fields(cls)
                     if f.default is dataclasses.MISSING and f.name not in raw)
    if unknown or missing:
      raise config_lib.ConfigError(f"--machine: {path}: " + "; ".join(
          ([f"unknown keys {unknown}"] if unknown else [])
          + ([f"missing keys {missing}"] if missing else [])))
    for k, v in raw.items():
      ok = (isinstance(v, int) and not isinstance(v, bool) and v > 0) if k == "devices" else (
          isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < 1e9)
      if not ok:
        raise config_lib.ConfigError(f"--machine: {path}: {k}={v!r} must be a positive number")
    return cls(**raw)

  def rates(self) -> Rates:
    return Rates(matmul_tflops=self.matmul_tflops, attention_tflops=self.attention_tflops,
                 h2d_gbps=self.h2d_gbps, d2h_gbps=self.d2h_gbps,
                 host_adamw_gparams=self.host_adamw_gparams,
                 host_adamw_in_step_gparams=self.host_adamw_gparams,
                 host_adamw_in_step_best_gparams=max(self.host_adamw_gparams,
                                                     Rates.host_adamw_in_step_best_gparams),
                 hbm_gbps=self.hbm_gbps, compute_capability=self.compute_capability)

  def plan(self, cfg: config_lib.Config) -> Plan:
    """The plan of `cfg` on this machine: every `auto` resolved, device bytes estimated."""
    cfg = with_devices(cfg, devices_of(cfg, self.devices))
    if cfg.train.batch % (cfg.engine.devices * (cfg.engine.micro_batch or 1)):
      raise PlanError(f"train.batch: {cfg.train.batch} sequences do not split evenly over "
                      f"{cfg.engine.devices} device(s)")
    return make(cfg, host_limit=int(self.host_memory_gb * GiB),
                device_limit=int(self.device_memory_gb * GiB * DEVICE_MEMORY_FRACTION),
                rates=self.rates())
