"""`detgate worker`: the OpenAI-compatible HTTP server in front of one engine.

`create_app(config)` builds the app from one router per endpoint module (status, completions,
score); the lifespan loads the model, starts the engine loop and puts the long-lived objects on
`app.state`. Every error becomes the OpenAI error shape in
`install_error_handlers`, the one place that maps exceptions to HTTP.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from worker.engine import sampler
from worker.engine.config import EngineConfig
from worker.engine.engine import AsyncEngine, Engine
from worker.errors import InvalidRequest, WorkerError
from worker.model.tokenizer import ChatTemplateError
from worker.server import completions, score, status
from worker.server.context import ServingContext
from worker.server.http import ClientDisconnected, json_response
from worker.server.metrics import WorkerMetrics

log = logging.getLogger("detgate.worker")


def create_app(config: EngineConfig) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        from worker.model.loader import load
        from worker.tools.model_source import resolve_model

        path = await asyncio.to_thread(resolve_model, config.model)
        loaded = await asyncio.to_thread(load, path, dtype=config.dtype, device=config.device,
                                         mode=config.mode)
        if config.mode == "batch_invariant" and config.device == "cpu" and config.self_check:
            from worker.model.invariance_check import check

            await asyncio.to_thread(check, loaded)
        engine = Engine(config, loaded.model, loaded.config)
        metrics = WorkerMetrics()
        metrics.bind(engine)
        async_engine = AsyncEngine(engine, on_step=metrics.observe_step,
                                   on_finish=metrics.observe_finished)
        async_engine.start()
        name = Path(config.model).name
        app.state.metrics = metrics
        app.state.ctx = ServingContext(
            engine=async_engine, tokenizer=loaded.tokenizer, config=config, model_name=name,
            model_aliases=frozenset({name, config.model, str(path)}),
            fingerprint=system_fingerprint(loaded.fingerprint_parts, config),
        )
        log.info("serving %s (%s, %s, %s): %d KV blocks of %d, context %d", name, config.mode,
                 config.dtype, config.device, engine.block_manager.num_blocks, config.block_size,
                 engine.max_model_len)
        yield
        await async_engine.stop()

    app = FastAPI(title="detgate worker", lifespan=lifespan)
    install_error_handlers(app)
    for endpoint in (status, completions, score):
        app.include_router(endpoint.router)
    return app


def system_fingerprint(parts: dict[str, str], config: EngineConfig) -> str:
    """A hash of everything that can change the numbers: the loader's parts (weights, config,
    mode, dtype, device, versions, kernels) and the sampler's source."""
    sampler_src = Path(sampler.__file__).read_bytes()
    everything = {**parts, "sampler_sha256": hashlib.sha256(sampler_src).hexdigest()}
    digest = hashlib.sha256(json.dumps(everything, sort_keys=True).encode()).hexdigest()
    return f"fp_{digest[:16]}"


def install_error_handlers(app: FastAPI) -> None:
    def error(status: int, message: str, type_: str, param: str | None = None,
              code: str | None = None) -> Response:
        return json_response({"error": {"message": message, "type": type_, "param": param,
                                        "code": code}}, status)

    @app.exception_handler(WorkerError)
    async def worker_error(_: Request, exc: WorkerError) -> Response:
        return error(exc.status, exc.message, exc.type, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> Response:
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        message = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            message, loc = "the request body is not valid JSON", []
        param = ".".join(loc) or None
        return error(400, f"{param}: {message}" if param else message, InvalidRequest.type, param,
                     first.get("type"))

    @app.exception_handler(ChatTemplateError)
    async def template_error(_: Request, exc: ChatTemplateError) -> Response:
        return error(400, f"chat template: {exc}", InvalidRequest.type, "messages")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> Response:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error(exc.status_code, str(exc.detail), kind)

    @app.exception_handler(ClientDisconnected)
    async def disconnected(_: Request, exc: ClientDisconnected) -> Response:
        return error(499, "client disconnected", "client_closed_request")

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> Response:
        log.exception("unhandled error")
        return error(500, "internal error", "internal_error")


def main(args) -> int:
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    config = EngineConfig.from_args(args)
    uvicorn.run(create_app(config), host=args.host, port=args.port, log_level="warning",
                timeout_graceful_shutdown=5)
    return 0
