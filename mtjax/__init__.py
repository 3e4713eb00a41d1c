"""mtjax: full-precision LLM training on one GPU, the training state in host memory (and, when
that is full, in GPU memory too), one layer's weights on the GPU at a time.

XLA caps its pinned host pool (which holds the master weights) at 64 GiB unless
XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB says otherwise; `mtjax.plan.prepare(cfg)` sets it from the plan
(`mtjax.plan.configure_pinned_pool`), as `python -m mtjax.train` does, and must run before the jax
backend starts.
"""
