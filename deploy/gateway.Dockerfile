# syntax=docker/dockerfile:1
# The gateway: the base install only (`pip install .`), so no torch and no triton in the image.
# Configuration and secrets come from the environment at run time, never from the image.
FROM python:3.12-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /build
COPY pyproject.toml README.md ./
COPY detgate detgate
RUN pip install . \
    && rm -rf /build \
    && useradd --system --create-home --uid 10001 detgate \
    && install -d -o detgate -g detgate /var/lib/detgate

WORKDIR /home/detgate
USER detgate
ENV DETGATE_HOST=0.0.0.0 \
    DETGATE_PORT=8000
EXPOSE 8000
CMD ["detgate", "gateway"]
