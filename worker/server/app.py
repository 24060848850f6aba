"""`detgate worker`: the OpenAI-compatible HTTP server in front of one engine.

`create_app(config)` builds the app; the lifespan loads the model, starts the engine loop and
puts the long-lived objects on `app.state`. Every error becomes the OpenAI error shape in
`install_error_handlers`, the one place that maps exceptions to HTTP.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from collections.abc import Awaitable
from contextlib import asynccontextmanager
from pathlib import Path

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from worker.engine import AsyncEngine, Engine
from worker.engine_config import EngineConfig
from worker.errors import InvalidRequest, WorkerError
from worker.metrics import WorkerMetrics
from worker.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    ScoreRequest,
    ScoreResponse,
)
from worker.responses import prepare, respond, stream
from worker.serving import ServingContext, score
from worker.tokenizer import ChatTemplateError

log = logging.getLogger("detgate.worker")


def create_app(config: EngineConfig) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        from worker.loader import load
        from worker.model_source import resolve_model

        path = await asyncio.to_thread(resolve_model, config.model)
        loaded = await asyncio.to_thread(load, path, dtype=config.dtype, device=config.device,
                                         mode=config.mode)
        if config.mode == "batch_invariant" and config.device == "cpu" and config.self_check:
            from worker.invariance_check import check

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
    _add_routes(app)
    return app


def system_fingerprint(parts: dict[str, str], config: EngineConfig) -> str:
    """A hash of everything that can change the numbers: the loader's parts (weights, config,
    mode, dtype, device, versions, kernels) and the sampler's source."""
    sampler_src = (Path(__file__).parent / "sampler.py").read_bytes()
    everything = {**parts, "sampler_sha256": hashlib.sha256(sampler_src).hexdigest()}
    digest = hashlib.sha256(json.dumps(everything, sort_keys=True).encode()).hexdigest()
    return f"fp_{digest[:16]}"


def _add_routes(app: FastAPI) -> None:
    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        return Response(request.app.state.metrics.render(),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        ctx: ServingContext = request.app.state.ctx
        return json_response(ModelList(data=[ModelCard(id=ctx.model_name, created=ctx.created,
                                                       max_model_len=ctx.max_model_len)]))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await _answer(request, body)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await _answer(request, body)

    @app.post("/v1/score")
    async def score_route(body: ScoreRequest, request: Request):
        ctx: ServingContext = request.app.state.ctx
        logprobs = await _unless_disconnected(request, score(ctx, body))
        return json_response(ScoreResponse(model=body.model, start=body.start,
                                           token_ids=body.token_ids, logprobs=logprobs,
                                           system_fingerprint=ctx.fingerprint))


async def _answer(request: Request, body: CompletionRequest | ChatCompletionRequest):
    ctx: ServingContext = request.app.state.ctx
    prepared = prepare(ctx, body)
    if body.stream:
        # Starlette cancels the body iterator when the client goes away; that aborts the
        # sequences (see serving.generate).
        return StreamingResponse(stream(ctx, prepared), media_type="text/event-stream")
    response = await _unless_disconnected(request, respond(ctx, prepared))
    return json_response(response)


def json_response(body, status: int = 200) -> Response:
    """orjson writes a float as the shortest text that reads back as the same double, so the
    float32 logprobs round-trip exactly."""
    if hasattr(body, "model_dump"):
        body = body.model_dump(exclude_none=True)
    return Response(orjson.dumps(body), status_code=status, media_type="application/json")


async def _unless_disconnected(request: Request, work: Awaitable):
    """Await `work`, cancelling it (which aborts its sequences) if the client disconnects."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise ClientDisconnected()
    return task.result()


class ClientDisconnected(Exception):
    """Nobody is left to answer; the status is only for the access log."""


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
