"""mtjax: full-precision LLM training on one GPU, the training state in host memory (and, when
that is full, in GPU memory too), one layer's weights on the GPU at a time.

XLA caps its pinned host pool (which holds the master weights) at 64 GiB unless
XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB says otherwise; `mtjax.launch.plan_run(cfg)` sets it from the
plan (`mtjax.launch.configure_pinned_pool`), as `python -m mtjax.train` does, and must run before
the jax backend starts.

The functional API (`mtjax.load_hf`, `mtjax.forward`, `mtjax.to_hf_names`) is mtjax.api's, and
`mtjax.generate(cfg, params, prompts, ...)` mtjax.generate's (the module calls through to its
`generate`), each loaded on first use.
"""

_API = ("load_hf", "forward", "to_hf_names")


def __getattr__(name):
  if name in _API:
    from mtjax import api  # imported on first use: `import mtjax` stays light
    return getattr(api, name)
  if name == "generate":
    import importlib
    return importlib.import_module("mtjax.generate")
  raise AttributeError(f"module 'mtjax' has no attribute {name!r}")
