"""The two reference servers of `detgate bench gateway`, each run as its own process.

- `upstream`: a canned OpenAI-style worker in raw asyncio (HTTP/1.1 keep-alive), answering
  a 16-token chat completion with logprobs and token ids in microseconds, so that what the
  benchmark measures is the path in front of it.
- `passthrough`: the bare gateway baseline: FastAPI + the gateway's upstream client + one
  Redis SET per request, no validation, routing or shaping.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import secrets

import orjson
import redis.asyncio as aioredis
from fastapi import FastAPI, Request
from starlette.responses import Response

from detgate.gateway.config import Settings
from detgate.gateway.upstream import Upstream

TOKENS = 16
FINGERPRINT = "fp_bench_canned"


def canned_chat() -> bytes:
    content = [{"token": f"t{i}", "logprob": -0.1 * (i + 1) - 1e-7 * i, "bytes": None,
                "top_logprobs": []} for i in range(TOKENS)]
    return orjson.dumps({
        "id": "chatcmpl-canned", "object": "chat.completion", "created": 0, "model": "canned",
        "system_fingerprint": FINGERPRINT,
        "choices": [{"index": 0, "finish_reason": "length",
                     "message": {"role": "assistant", "content": "".join(
                         e["token"] for e in content)},
                     "logprobs": {"content": content},
                     "token_ids": list(range(100, 100 + TOKENS))}],
        "usage": {"prompt_tokens": 8, "completion_tokens": TOKENS, "total_tokens": 8 + TOKENS},
    })


def canned_completion() -> bytes:
    return orjson.dumps({
        "id": "cmpl-canned", "object": "text_completion", "created": 0, "model": "canned",
        "system_fingerprint": FINGERPRINT,
        "choices": [{"index": 0, "text": "x", "finish_reason": "length", "token_ids": [7],
                     "logprobs": {"tokens": ["x"], "token_logprobs": [-0.5],
                                  "top_logprobs": [{"x": -0.5}], "text_offset": [0]}}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
    })


ROUTES = {
    b"GET /health": b"{}",
    b"GET /v1/models": orjson.dumps({"object": "list", "data": [
        {"id": "canned", "object": "model", "created": 0, "owned_by": "bench"}]}),
    b"POST /v1/chat/completions": canned_chat(),
    b"POST /v1/completions": canned_completion(),
}


async def _serve_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            request_line, _, headers = head.partition(b"\r\n")
            method, path, _ = request_line.split(b" ", 2)
            length = 0
            for line in headers.split(b"\r\n"):
                if line[:15].lower() == b"content-length:":
                    length = int(line[15:])
            if length:
                await reader.readexactly(length)
            body = ROUTES.get(method + b" " + path)
            status = b"200 OK" if body is not None else b"404 Not Found"
            body = body if body is not None else b'{"error":{"message":"not found"}}'
            writer.write(b"HTTP/1.1 " + status + b"\r\nContent-Type: application/json\r\n"
                         b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError, ValueError):
        pass
    finally:
        writer.close()


async def _upstream(port: int) -> None:
    server = await asyncio.start_server(_serve_conn, "127.0.0.1", port, backlog=1024)
    async with server:
        await server.serve_forever()


def _passthrough_app(upstream_url: str, redis_url: str, prefix: str):
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        settings = Settings()  # the gateway's own connection settings, for a fair baseline
        app.state.upstream = Upstream(connect_timeout_s=settings.connect_timeout_s,
                                      keepalive_s=settings.upstream_keepalive_s,
                                      progress_timeout_s=settings.progress_timeout_s)
        app.state.redis = aioredis.Redis.from_url(redis_url)
        yield
        await app.state.upstream.close()
        await app.state.redis.aclose()

    app = FastAPI(lifespan=lifespan)

    @app.get("/health")
    async def health() -> Response:
        return Response(b"{}", media_type="application/json")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = orjson.loads(await request.body())
        answer = await app.state.upstream.post(upstream_url + "/v1/chat/completions",
                                               orjson.dumps(body), 30.0)
        await app.state.redis.set(f"{prefix}:{secrets.token_hex(8)}", answer.body, ex=300)
        return Response(answer.body, media_type="application/json")

    return app


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("server", choices=["upstream", "passthrough"])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--upstream", default="")
    p.add_argument("--redis-url", default="")
    p.add_argument("--prefix", default="")
    args = p.parse_args(argv)
    if args.server == "upstream":
        try:
            import uvloop
            uvloop.install()
        except ImportError:
            pass
        asyncio.run(_upstream(args.port))
        return
    import uvicorn
    uvicorn.run(_passthrough_app(args.upstream, args.redis_url, args.prefix), host="127.0.0.1",
                port=args.port, access_log=False, log_level="warning")


if __name__ == "__main__":
    main()
