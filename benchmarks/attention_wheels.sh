#!/usr/bin/env bash
# Downloads the wheels benchmarks/attention_kernels.py needs for tokamax's attention on the GPU
# machine into DIR (default .whl/, git-ignored; carry it to the device), and prints their sizes.
# The image has jax, flax, jaxtyping, absl-py, numpy and tqdm; tokamax imports, at import time,
# pydantic (with pydantic-core, annotated-types, typing-inspection and a typing-extensions new enough
# for it), einshape, immutabledict and qwix. Left out: xprof (its benchmarking module's xprof timer;
# with gcsfs and the rest it is tens of MB, so attention_kernels.py registers a stand-in) and
# tensorboardx (tokamax's own benchmark scripts). Never a jax wheel: jax stays the image's.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.whl}
mkdir -p "$DIR"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$DIR" tokamax==0.0.17 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
  typing-inspection==0.4.5 typing-extensions==4.16.0 einshape==1.0 immutabledict==4.3.1 qwix==0.1.8
for name in tokamax pydantic pydantic_core annotated_types typing_inspection typing_extensions \
    einshape immutabledict qwix; do
  ls -l "$DIR"/"$name"-[0-9]*.whl
done | awk '{print $5, $NF; total += $5} END {printf "total %.1f MiB\n", total / 2^20}'
