import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache for the whole run, shared by the xdist workers and the
# subprocesses that tests start (they inherit the environment): many tests compile the same layer
# functions at the same tiny shapes, and a hit returns the executable XLA compiled for the same
# program, so the numerics are those of a fresh compile (an entry read while another process still
# writes it fails to decompress: jax warns and compiles). The controller makes the folder (the
# workers inherit the variable) and removes it at the end; a cache set from outside is kept.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="mtjax-tests-jax-cache-")
  os.environ["MTJAX_TESTS_OWN_JAX_CACHE"] = os.environ["JAX_COMPILATION_CACHE_DIR"]
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax
import pytest
from hypothesis import settings

jax.config.update("jax_numpy_rank_promotion", "raise")

# `python -m pytest` (the README's test command) runs each hypothesis sweep over a few examples;
# the soak run, `MTJAX_SOAK=1 python -m pytest -m "soak or sweep"` (.ci/run runs it after), runs
# the same sweeps wide and the tests marked soak. Each example compiles a fresh set of layer
# functions: no per-example deadline.
SOAK = os.environ.get("MTJAX_SOAK") == "1"
settings.register_profile("mtjax", max_examples=30 if SOAK else 3, deadline=None,
                          derandomize=True, print_blob=True)
settings.load_profile("mtjax")


def pytest_collection_modifyitems(items):
  for item in items:  # every hypothesis test is a sweep, run again wide by the soak run
    if getattr(getattr(item, "obj", None), "is_hypothesis_test", False):
      item.add_marker(pytest.mark.sweep)


def pytest_sessionfinish(session):
  own = os.environ.get("MTJAX_TESTS_OWN_JAX_CACHE")
  if own and not hasattr(session.config, "workerinput"):  # the controller, after the workers
    shutil.rmtree(own, ignore_errors=True)
