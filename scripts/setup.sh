#!/usr/bin/env bash
# Creates .venv with pagedllm (editable), its test tools and the tritonserver binary.
# Usage: bash scripts/setup.sh [python-executable]
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${1:-python3}

"$PYTHON" -m venv .venv
. .venv/bin/activate
python -m pip install --quiet --upgrade pip
# Pin the CPU build first: an unpinned torch would pull a multi-gigabyte CUDA build.
# On a GPU machine, install the torch you want before running this script.
python -c "import torch" 2>/dev/null || python -m pip install --quiet torch==2.13.0
python -m pip install --quiet -e ".[test,bench]"
# The wheel carries a real tritonserver with the Python backend; it is only a binary
# to us, and its dependency pins (numpy<2, an old tritonclient) would clash.
python -m pip install --quiet --no-deps nvidia-pytriton==0.7.0
# The wheel's backend stub needs NumPy 1.x beside it: prepare its small environment now,
# so the first `pagedllm serve` needs no network (see backend/serving/stub_env.py).
python -m pagedllm.serving.stub_env
python -c "import pagedllm, torch, transformers; print('pagedllm ready: torch', torch.__version__, '| transformers', transformers.__version__)"
