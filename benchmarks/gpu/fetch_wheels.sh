#!/usr/bin/env bash
# Fetch, here, the wheels the GPU machine lacks, into .whl/ (git-ignored), for
# benchmarks/gpu/run.sh to install there. That machine reaches no package index; its image has
# Python 3.12 and torch (docs/performance.md, twenty-fourth section, "the GPU table,
# prepared"). Pure-Python wheels, ~0.5 MB:
#   tomli-w (normlab writes TOML); x-transformers and its needs (the train-step reference),
#   einops among them, pinned too (torch-einops-utils needs >= 0.8.1; the image's is unknown).
# The versions are the ones this project's CPU venv runs, so both tables time the same code.
#   bash benchmarks/gpu/fetch_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .whl
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl \
  tomli-w==1.2.0 x-transformers==2.31.10 einx==0.4.3 loguru==0.7.3 \
  torch-einops-utils==0.2.0 frozendict==2.5.1 einops==0.8.2
ls .whl
