"""`detgate worker`: the OpenAI-compatible HTTP server in front of one engine.

`create_app(config)` builds the app from one router per endpoint module (status, completions,
score, admin, abort); the lifespan loads the model, starts the engine loop and puts the
long-lived objects on `app.state`. Every error becomes the OpenAI error shape in
`install_error_handlers`, the one place that maps exceptions to HTTP.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from detgate.contract import errors
from detgate.worker.engine.async_engine import AsyncEngine
from detgate.worker.engine.config import EngineConfig
from detgate.worker.engine.engine import Engine
from detgate.worker.errors import InvalidRequest, WorkerError
from detgate.worker.model import grammar
from detgate.worker.model.tokenizer import ChatTemplateError
from detgate.worker.model.weight_update import WeightStager
from detgate.worker.server import abort, admin, completions, score, status
from detgate.worker.server.admin import WeightAdmin, read_admin_token
from detgate.worker.server.context import ServingContext
from detgate.worker.server.http import ClientDisconnected, json_response
from detgate.worker.server.metrics import WorkerMetrics

log = logging.getLogger("detgate.worker")


def create_app(config: EngineConfig, admin_token: str | None = None, *,
               stall_timeout_s: float = 60.0) -> FastAPI:
    """`admin_token`: the bearer token of the weight-update endpoint (None: updates refused);
    `stall_timeout_s`: how long one engine step may run before /health says the worker hangs."""
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        from detgate.worker.model.loader import load
        from detgate.worker.tools.model_source import resolve_model

        path = await asyncio.to_thread(resolve_model, config.model)
        loaded = await asyncio.to_thread(load, path, dtype=config.dtype, device=config.device,
                                         mode=config.mode,
                                         weights_format=config.weights_format)
        if config.mode == "batch_invariant" and config.device == "cpu" and config.self_check:
            from detgate.worker.model.invariance_check import check

            await asyncio.to_thread(check, loaded)
        engine = Engine(config, loaded.model, loaded.config)
        if config.warm_up:
            warmed = await asyncio.to_thread(engine.warm_up)
            if warmed:
                log.info("warmed up: %s", warmed)
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
            grammar=grammar.GrammarCompiler(loaded.tokenizer, loaded.config.vocab_size),
            eos_token_ids=engine.eos_token_ids, fingerprint_parts=loaded.fingerprint_parts,
            machine=loaded.machine,
            max_token_chars=loaded.tokenizer.max_token_chars() + 1,
            stall_timeout_s=stall_timeout_s,
        )
        app.state.admin = WeightAdmin(admin_token, app.state.ctx,
                                      WeightStager(loaded.model, loaded.config))
        log.info("serving %s (%s, %s, %s): %d KV blocks of %d, context %d; fingerprint %s on "
                 "%s", name, config.mode, config.dtype, config.device,
                 engine.block_manager.num_blocks, config.block_size, engine.max_model_len,
                 app.state.ctx.fingerprint, app.state.ctx.machine)
        yield
        await async_engine.stop()

    app = FastAPI(title="detgate worker", lifespan=lifespan)
    install_error_handlers(app)
    for endpoint in (status, completions, score, admin, abort):
        app.include_router(endpoint.router)
    return app


def install_error_handlers(app: FastAPI) -> None:
    def error(status: int, message: str, type_: str, param: str | None = None,
              code: str | None = None) -> Response:
        return json_response(errors.error_body(message, type_, param, code), status)

    @app.exception_handler(WorkerError)
    async def worker_error(_: Request, exc: WorkerError) -> Response:
        return error(exc.status, exc.message, exc.type, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> Response:
        message, param, code = errors.validation_error(exc.errors())
        return error(400, message, InvalidRequest.type, param, code)

    @app.exception_handler(ChatTemplateError)
    async def template_error(_: Request, exc: ChatTemplateError) -> Response:
        return error(400, f"chat template: {exc}", InvalidRequest.type, "messages")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> Response:
        return error(exc.status_code, str(exc.detail), errors.http_error_type(exc.status_code))

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
    app = create_app(config, read_admin_token(args.admin_token_file),
                     stall_timeout_s=args.stall_timeout_s)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning",
                timeout_graceful_shutdown=5, timeout_keep_alive=args.keepalive_timeout_s)
    return 0
