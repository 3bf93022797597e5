"""`twostep serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over the AsyncEngine: the
app, its middleware and routes put together, the OpenAPI schema made true to the server, and the
process's lifecycle (signals, graceful shutdown).

Every HTTP request becomes one engine request per prompt (n samples fan out inside the engine;
fan_out.py); their outputs share one asyncio queue. Streaming responses are server-sent events
ending with `data: [DONE]` (sse.py); a client that goes away aborts its requests at once.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import signal
from collections.abc import Callable

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from twostep.engine.llm_engine import LLMEngine
from twostep.entrypoints.async_engine import AsyncEngine
from twostep.entrypoints.openai.anthropic_messages import add_anthropic_routes
from twostep.entrypoints.openai.errors import install_error_handlers
from twostep.entrypoints.openai.metrics import ServerMetrics
from twostep.entrypoints.openai.middleware import BodySizeLimit, RequireAPIKey, is_loopback
from twostep.entrypoints.openai.pooling import add_pooling_routes
from twostep.entrypoints.openai.responses_api import add_responses_routes
from twostep.entrypoints.openai.routes import add_routes
from twostep.entrypoints.openai.state import QUEUED_PER_RUNNING, ServerConfig, ServerState
from twostep.outputs import RequestOutput

logger = logging.getLogger(__name__)


def build_app(llm_engine: LLMEngine, config: ServerConfig) -> FastAPI:
    if config.max_queued_requests is None:
        config = dataclasses.replace(config, max_queued_requests=QUEUED_PER_RUNNING * llm_engine.config.max_num_seqs)
    model_name = config.model_name
    metrics = ServerMetrics(model_name)

    def on_step(engine: LLMEngine, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            if out.finished:
                metrics.observe_finished(out)
        metrics.refresh(engine)

    state = ServerState(AsyncEngine(llm_engine, config.max_queued_requests, config.request_timeout,
                                    on_step), model_name, metrics, config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        state.engine.start()
        yield
        await state.engine.shutdown()
        llm_engine.shutdown()

    app = FastAPI(title="twostep", lifespan=lifespan)
    app.state.twostep = state
    app.state.api_key = config.api_key
    install_error_handlers(app)
    if config.api_key:
        app.add_middleware(RequireAPIKey, api_key=config.api_key,
                           open_paths={"/health"} | (set() if config.metrics_need_key else {"/metrics"}))
    app.add_middleware(BodySizeLimit, max_bytes=config.max_request_body_bytes)
    add_routes(app, state)
    add_pooling_routes(app, state)
    add_anthropic_routes(app, state)
    add_responses_routes(app, state)
    app.openapi = lambda: _openapi(app, bool(config.api_key), config.metrics_need_key)
    return app


def _openapi(app: FastAPI, with_key: bool, metrics_need_key: bool) -> dict:
    """FastAPI's schema, made true to the server: invalid input is a 400 in OpenAI's shape (FastAPI
    declares a 422 the server never sends), and with an API key every route but /health may 401."""
    if app.openapi_schema is None:
        schema = get_openapi(title="twostep", version="0.1.0", routes=app.routes)
        error = {"description": "invalid request",
                 "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
        for path, methods in schema["paths"].items():
            for op in methods.values():
                responses = op["responses"]
                if responses.pop("422", None) is not None:
                    responses.setdefault("400", error)
                if with_key and path != "/health" and (path != "/metrics" or metrics_need_key):
                    responses.setdefault("401", {**error, "description": "missing or wrong API key"})
        for unused in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(unused, None)
        app.openapi_schema = schema
    return app.openapi_schema


def run_server(llm_engine: LLMEngine, config: ServerConfig, host: str, port: int,
               log_level: str = "info", graceful_timeout: float = 5.0) -> int:
    app = build_app(llm_engine, config)
    engine: AsyncEngine = app.state.twostep.engine
    return serve_app(app, host, port, log_level, graceful_timeout, engine)


def serve_app(app, host: str, port: int, log_level: str = "info", graceful_timeout: float = 5.0,
              engine: AsyncEngine | None = None, abort_all: Callable[[], None] | None = None) -> int:
    """Run app under uvicorn until SIGINT/SIGTERM (or the engine's failure); the exit code. After
    graceful_timeout seconds of shutdown, abort_all (default: the engine's) ends what still runs."""
    import uvicorn

    api_key = getattr(app.state, "api_key", None)
    if not api_key and not is_loopback(host):
        logger.warning("listening on %s without an API key: anyone who can reach port %d can use "
                       "this server (set --api-key or TWOSTEP_API_KEY)", host, port)
    # In-flight requests get graceful_timeout seconds to finish, then are aborted so their
    # streams end properly (finish_reason "abort", [DONE]); uvicorn waits a little longer.
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level.lower(),
                            timeout_graceful_shutdown=graceful_timeout + 5.0)
    server = _QuietSignalsServer(config)

    failed: list[BaseException] = []

    async def serve() -> None:
        loop = asyncio.get_running_loop()

        def on_failure(error: BaseException) -> None:   # the engine cannot serve any more: exit
            failed.append(error)
            loop.call_soon_threadsafe(server.request_exit)

        if engine is not None:
            engine.on_failure = on_failure

        def on_signal() -> None:
            if server.should_exit:
                return
            server.request_exit()
            end = abort_all or (engine.abort_all if engine is not None else None)
            if end is not None:
                loop.call_later(graceful_timeout, end)

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal)
        await server.serve()

    asyncio.run(serve())
    if failed:
        logger.error("exiting: the engine failed: %s", failed[0])
        return 1
    return 0


class _QuietSignalsServer:
    """uvicorn.Server whose shutdown we trigger from our own signal handlers, so SIGTERM
    ends in a clean exit 0 (uvicorn would re-raise the signal after shutting down)."""

    def __new__(cls, config):
        import uvicorn

        class Server(uvicorn.Server):
            def install_signal_handlers(self) -> None:  # older uvicorn
                pass

            @contextlib.contextmanager
            def capture_signals(self):  # newer uvicorn
                yield

            def request_exit(self) -> None:
                logger.info("shutting down: no new connections, finishing in-flight requests")
                self.should_exit = True

        return Server(config)
