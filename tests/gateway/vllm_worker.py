"""A worker that answers with vLLM's documented response shapes, from tests/gateway/fixtures.

It runs an aiohttp server on its own thread and remembers every request body it got, so
tests can also prove that nothing was forwarded. Shapes follow vLLM's OpenAI server
protocol: `token_ids` per choice with `return_token_ids`, `prompt_token_ids`,
`prompt_logprobs`, no `system_fingerprint`, errors with an integer `code`, `/version`.
"""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import orjson
from aiohttp import web

from tests.support.procs import free_port

FIXTURES = Path(__file__).parent / "fixtures"
PROBE_PROMPT = "detgate fingerprint probe"


def fixture(name: str) -> bytes:
    return (FIXTURES / name).read_bytes()


class VllmFixtureWorker:
    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.received: list[tuple[str, dict]] = []
        # Set by tests: answer every generation with this status, or only after a delay.
        self.fail_status: int | None = None
        self.delay_s = 0.0
        self.stream_gap_s = 0.0  # between the lines of a streamed answer
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None

    def forwarded(self) -> list[tuple[str, dict]]:
        """Requests that reached this worker, without the gateway's fingerprint probes."""
        return [(p, b) for p, b in self.received if b.get("prompt") != PROBE_PROMPT]

    def start(self) -> None:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/version", self._static("vllm_version.json"))
        app.router.add_get("/v1/models", self._static("vllm_models.json"))
        app.router.add_post("/v1/chat/completions", self._generate("chat"))
        app.router.add_post("/v1/completions", self._generate("completion"))
        # Handlers still sleeping (a test's delay) are cut after 2 s when the worker stops.
        self._runner = web.AppRunner(app, shutdown_timeout=2.0)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    @staticmethod
    async def _health(request: web.Request) -> web.Response:
        return web.Response(status=200)

    @staticmethod
    def _static(name: str):
        async def handler(request: web.Request) -> web.Response:
            return web.Response(body=fixture(name), content_type="application/json")
        return handler

    def _generate(self, kind: str):
        async def handler(request: web.Request) -> web.StreamResponse:
            body = await request.json()
            self.received.append((request.path, body))
            probe = body.get("prompt") == PROBE_PROMPT
            if self.delay_s and not probe:
                await asyncio.sleep(self.delay_s)
            if self.fail_status is not None and not probe:
                return web.Response(status=self.fail_status, body=fixture("vllm_error.json"),
                                    content_type="application/json")
            text = json.dumps(body.get("messages") or body.get("prompt"))
            if "trigger-error" in text:
                name = "vllm_error_legacy.json" if "legacy" in text else "vllm_error.json"
                return web.Response(status=400, body=fixture(name),
                                    content_type="application/json")
            if not body.get("stream"):
                name = f"vllm_{kind}.json"
                if kind == "completion" and body.get("prompt_logprobs") is not None:
                    name = "vllm_completion_prompt_logprobs.json"
                return web.Response(body=fixture(name), content_type="application/json")
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            lines = fixture(f"vllm_{kind}_stream.txt").splitlines(keepends=True)
            if "trigger-break" in text:  # the worker dies after two events
                for line in lines[:4]:
                    await response.write(line)
                await asyncio.sleep(0.3)  # let those events leave before the connection drops
                request.transport.close()
                return response
            for line in lines:
                await response.write(line)
                if self.stream_gap_s and line.strip():
                    await asyncio.sleep(self.stream_gap_s)
            await response.write_eof()
            return response
        return handler


def sse_payloads(raw: bytes) -> list[dict]:
    """The JSON events of an SSE fixture, without [DONE]."""
    out = []
    for line in raw.splitlines():
        if line.startswith(b"data: ") and line[6:] != b"[DONE]":
            out.append(orjson.loads(line[6:]))
    return out
