"""mtjax: full-precision LLM training on one GPU, with all training state resident in host memory.

XLA caps its pinned host pool (which holds the master weights) at 64 GiB unless
XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB says otherwise; `mtjax.plan.configure_pinned_pool(plan)` sets it
from a plan, as `python -m mtjax.train` does, and must run before the jax backend starts.
"""
