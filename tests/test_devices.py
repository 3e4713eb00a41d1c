"""Several devices: the data-parallel cases in tests/data_parallel_cases.py, run on 4 simulated CPU
devices in a fresh process (a process's device count is fixed when its backend starts)."""

import os
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent


def test_data_parallel_cases_on_four_simulated_devices():
  env = {**os.environ, "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "")
                                     + " --xla_force_host_platform_device_count=4").strip()}
  r = subprocess.run([sys.executable, "-m", "pytest", "-o", "addopts=", "-p", "no:cacheprovider",
                      "-W", "ignore::UserWarning", str(HERE / "data_parallel_cases.py")],
                     env=env, cwd=HERE.parent, capture_output=True, text=True, timeout=900)
  assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
  summary = r.stdout.strip().splitlines()[-1]
  assert re.search(r"\b6 passed\b", summary) and "skipped" not in summary, summary
