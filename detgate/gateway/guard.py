"""Open mode's guard against web pages: no keys means anything that can reach the port is a
client, and a browser reaches loopback ports on behalf of every page it shows.

Two rules close the two ways in. A POST must say `Content-Type: application/json`: a page
can send a cross-origin POST without asking first only as text/plain or a form, and a JSON
POST needs a CORS preflight that this gateway never grants. And the `Host` header must be a
loopback name: DNS rebinding points a page's own name at 127.0.0.1, so its requests carry
that name, and are refused, however the address resolved.
"""

from __future__ import annotations

import ipaddress

from detgate.gateway.errors import GatewayError, error_response


class HostNotAllowed(GatewayError, status=403, type="permission_error", code="host_not_allowed"):
    """A `Host` header that is not a loopback name (DNS rebinding)."""


class UnsupportedMediaType(GatewayError, status=415, type="invalid_request_error",
                           code="unsupported_media_type"):
    """A POST that is not `Content-Type: application/json` (a page's simple request)."""


def loopback_host(host: str) -> bool:
    """`localhost`, `x.localhost`, 127.0.0.0/8, [::1], each with or without a port."""
    if host.startswith("["):
        name, _, rest = host[1:].partition("]")
        if rest and not (rest.startswith(":") and rest[1:].isdigit()):
            return False
    else:
        name, _, port = host.partition(":")
        if port and not port.isdigit():
            return False
    name = name.rstrip(".").lower()
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


# Verdicts on Host headers seen: a client sends the same one on every request, and parsing an
# address costs more than the rest of the check. Bounded: a flood of made-up names is
# answered as correctly, only without the cache.
_VERDICTS: dict[bytes, bool] = {}
_MAX_VERDICTS = 256


def _loopback(host: bytes) -> bool:
    verdict = _VERDICTS.get(host)
    if verdict is None:
        verdict = loopback_host(host.decode("latin-1"))
        if len(_VERDICTS) < _MAX_VERDICTS:
            _VERDICTS[host] = verdict
    return verdict


def _json_type(value: bytes) -> bool:
    return value == b"application/json" or \
        value.split(b";", 1)[0].strip().lower() == b"application/json"


def refusal(scope) -> GatewayError | None:
    """Why open mode refuses this HTTP request, or None."""
    host = content_type = None
    for name, value in scope["headers"]:
        if name == b"host":
            host = value
        elif name == b"content-type":
            content_type = value
    if host is None or not _loopback(host):
        return HostNotAllowed("open mode (no API keys) answers only requests whose Host is a "
                              "loopback name, such as localhost")
    if scope["method"] == "POST" and (content_type is None or not _json_type(content_type)):
        return UnsupportedMediaType("POST bodies must be sent as "
                                    "'Content-Type: application/json'")
    return None


class OpenModeGuard:
    """ASGI middleware, installed only in open mode (the hot routes check `refusal` in
    gateway/front.py)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            refused = refusal(scope)
            if refused is not None:
                await error_response(refused)(scope, receive, send)
                return
        await self.app(scope, receive, send)
