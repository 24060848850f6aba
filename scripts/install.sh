#!/usr/bin/env bash
# Create .venv with everything detgate needs on a CPU machine: the CPU build of torch first,
# so that nothing pulls a CUDA build, then detgate itself with all its extras.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q "torch==${DETGATE_TORCH_VERSION:-2.13.0}"
python -m pip install -q -e '.[all,test]'
