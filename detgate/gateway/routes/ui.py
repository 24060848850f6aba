"""`GET /ui/`: the records and replays page, as static files under a strict Content-Security-Policy.

The files hold no data and need no key: the page asks the API for everything, with the key
the user enters (kept in the tab's session storage, sent as a Bearer header), so a tenant
sees exactly what the API shows it. Scripts come only from these files (no inline script,
no eval), and Trusted Types forbid assigning HTML strings to the DOM at all: record text can
only ever become text.
"""

from __future__ import annotations

from importlib.resources import files

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Route

CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; "
       "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; "
       "frame-ancestors 'none'; require-trusted-types-for 'script'; trusted-types 'none'")
HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff",
           "Referrer-Policy": "no-referrer", "X-Frame-Options": "DENY",
           "Cache-Control": "no-cache"}
# URL path -> (file in gateway/ui, media type); nothing else under /ui/ is served.
_FILES = {"/ui/": ("index.html", "text/html; charset=utf-8"),
          "/ui/app.js": ("app.js", "text/javascript; charset=utf-8"),
          "/ui/drift.js": ("drift.js", "text/javascript; charset=utf-8"),
          "/ui/style.css": ("style.css", "text/css; charset=utf-8")}


def routes() -> list[Route]:
    """The page's routes, with the files read once, when the app is built."""
    folder = files("detgate.gateway") / "ui"
    out = [Route("/ui", _to_slash, methods=["GET"])]
    for path, (name, media_type) in _FILES.items():
        out.append(Route(path, _static((folder / name).read_bytes(), media_type),
                         methods=["GET"]))
    return out


async def _to_slash(request: Request) -> Response:
    return RedirectResponse("/ui/", status_code=308)


def _static(body: bytes, media_type: str):
    async def serve(request: Request) -> Response:
        return Response(body, media_type=media_type, headers=HEADERS)
    return serve
