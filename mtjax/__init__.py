"""mtjax: full-precision LLM training on one GPU, with all training state resident in host memory."""

import os

# XLA caps its pinned host pool at 64 GiB unless told otherwise; the master weights of a 16B model
# alone exceed that. Raise the cap before any backend starts (a user's own setting wins).
os.environ.setdefault("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "1024")
