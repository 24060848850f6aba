"""`detgate gateway`: serve the app with uvicorn (uvloop + httptools when installed)."""

from __future__ import annotations

import logging
import sys

import uvicorn
from prometheus_client import disable_created_metrics
from pydantic import ValidationError

from gateway.app import create_app
from gateway.config import Settings


def main(args) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    # The contract lists every series /metrics serves; no `*_created` companions.
    disable_created_metrics()
    try:
        settings = Settings()
        app = create_app(settings)
    except (ValidationError, ValueError) as exc:
        print(f"detgate gateway: bad configuration: {exc}", file=sys.stderr)
        return 2
    logging.getLogger("detgate.gateway").info(
        "gateway on http://%s:%d, %d worker(s), %s", settings.host, settings.port,
        len(settings.workers), "open mode" if not settings.api_keys else
        f"{len(settings.api_keys)} API key(s)")
    uvicorn.run(app, host=settings.host, port=settings.port, loop="auto", http="auto",
                access_log=False, log_level="warning", timeout_graceful_shutdown=5)
    return 0
