#!/usr/bin/env bash
# Builds the wheels benchmarks/deepspeed_baseline.py needs on the GPU machine (its image has torch and
# transformers but not deepspeed, hjson or pydantic) into .whl/ (git-ignored; carry it to the device).
# DeepSpeed publishes a source archive only: build it once as pure Python with DS_BUILD_OPS=0 (no
# torch needed for that; DS_ACCELERATOR=cuda records the accelerator it will run on).
set -euo pipefail
cd "$(dirname "$0")/.."
DS=${DS:-0.19.8}
mkdir -p .whl /tmp/dsbuild
EXCLUDE=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$EXCLUDE")"
grep -qsx "/.whl/" "$EXCLUDE" || echo "/.whl/" >> "$EXCLUDE"
python3 -m venv /tmp/dsbuild/venv
/tmp/dsbuild/venv/bin/pip install -q numpy packaging setuptools wheel
python3 -m pip download -q --no-deps --no-binary :all: "deepspeed==$DS" -d /tmp/dsbuild
tar xzf "/tmp/dsbuild/deepspeed-$DS.tar.gz" -C /tmp/dsbuild
(cd "/tmp/dsbuild/deepspeed-$DS" && DS_BUILD_OPS=0 DS_ACCELERATOR=cuda /tmp/dsbuild/venv/bin/pip wheel -q --no-deps \
  --no-build-isolation -w "$OLDPWD/.whl" .)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl hjson pydantic pydantic-core annotated-types typing-inspection "typing-extensions>=4.16"
ls .whl
