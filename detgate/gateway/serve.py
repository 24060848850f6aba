"""`detgate gateway`: serve the app with uvicorn (uvloop, httptools with the limits of
gateway/edge.py).

SIGTERM or Ctrl-C: uvicorn stops accepting and closes idle connections; the app's drain
gives requests in flight `DETGATE_SHUTDOWN_GRACE_S` to finish, then aborts the rest (error
shape, `aborted` records); uvicorn's own cancellation comes only after that, as a backstop.
"""

from __future__ import annotations

import logging
import sys

import uvicorn
from prometheus_client import disable_created_metrics
from pydantic import ValidationError

from detgate.gateway.app import create_app
from detgate.gateway.config import Settings
from detgate.gateway.edge import protocol
from detgate.gateway.front import Front


class GatewayServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, app: Front, grace_s: float) -> None:
        super().__init__(config)
        self.drain = app.state.drain
        self.grace_s = grace_s

    async def shutdown(self, sockets=None) -> None:
        self.drain.begin(self.grace_s)
        await super().shutdown(sockets)


def main(args) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    # The contract lists every series /metrics serves; no `*_created` companions.
    disable_created_metrics()
    try:
        settings = Settings()
        app = create_app(settings)
    except ValidationError as exc:
        # Never the input: it may be DETGATE_API_KEYS or a worker URL with a password.
        problems = "; ".join(f"DETGATE_{'.'.join(map(str, e['loc'])).upper()}: {e['msg']}"
                             for e in exc.errors(include_url=False, include_input=False))
        print(f"detgate gateway: bad configuration: {problems}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"detgate gateway: bad configuration: {exc}", file=sys.stderr)
        return 2
    logging.getLogger("detgate.gateway").info(
        "gateway on http://%s:%d, %d worker(s), %s", settings.host, settings.port,
        len(settings.workers), "open mode" if not settings.api_keys else
        f"{len(settings.api_keys)} API key(s)")
    config = uvicorn.Config(
        app, host=settings.host, port=settings.port, loop="auto", http=protocol(settings),
        # No websockets: an upgrade request is served as the plain HTTP request it also is,
        # so it gets the error shape (404/405) like any other unknown route.
        ws="none",
        access_log=False, log_level="warning", timeout_keep_alive=settings.keepalive_timeout_s,
        # The drain aborts at the grace; this leaves the aborted requests time to be recorded.
        timeout_graceful_shutdown=settings.shutdown_grace_s + 10)
    GatewayServer(config, app, settings.shutdown_grace_s).run()
    return 0
