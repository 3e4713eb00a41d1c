"""Several devices and several hosts, simulated on the CPU: the data-parallel cases in
tests/data_parallel_cases.py on 4 devices in a fresh process (a process's device count is fixed
when its backend starts), and tests/multihost_case.py as two processes of two devices each joined
by jax.distributed."""

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent


@pytest.mark.soak  # six engine cases in a process of four simulated devices: a minute of CPU
def test_data_parallel_cases_on_four_simulated_devices():
  env = {**os.environ, "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "")
                                     + " --xla_force_host_platform_device_count=4").strip()}
  r = subprocess.run([sys.executable, "-m", "pytest", "-o", "addopts=", "-p", "no:cacheprovider",
                      "-W", "ignore::UserWarning", str(HERE / "data_parallel_cases.py")],
                     env=env, cwd=HERE.parent, capture_output=True, text=True, timeout=900)
  assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
  summary = r.stdout.strip().splitlines()[-1]
  assert re.search(r"\b6 passed\b", summary) and "skipped" not in summary, summary


@pytest.mark.soak  # long; the README run's time budget (the soak runs it)
def test_two_hosts_split_the_state_and_match_the_reference():
  with socket.socket() as sock:  # a free port for the coordinator
    sock.bind(("localhost", 0))
    port = sock.getsockname()[1]
  env = {**os.environ, "PYTHONPATH": str(HERE.parent)}
  procs = [subprocess.Popen([sys.executable, "-W", "ignore", str(HERE / "multihost_case.py"),
                             str(pid), str(port)], env=env, cwd=HERE.parent, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for pid in (0, 1)]
  outs = []
  try:
    for p in procs:
      outs.append(p.communicate(timeout=600)[0])
  finally:
    for p in procs:
      p.kill()
  for pid, (p, out) in enumerate(zip(procs, outs)):
    tail = "\n".join(line for line in out.splitlines() if "Gloo" not in line)[-4000:]
    assert p.returncode == 0 and f"ok: process {pid} owns groups" in out, tail
