import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
from hypothesis import settings  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")

# Each example compiles a fresh set of layer functions: few examples, no per-example deadline.
settings.register_profile("mtjax", max_examples=5, deadline=None, derandomize=True,
                          print_blob=True)
settings.load_profile("mtjax")
