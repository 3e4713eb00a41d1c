import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

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
