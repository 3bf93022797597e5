"""`twostep proxy`: one OpenAI-compatible front for disaggregated prefill and decode.

It stands before twostep servers of two kinds: prefill instances (started with kv_role
kv_producer) and decode instances (kv_consumer), and mirrors vLLM's disaggregated-prefill toy
proxy (toy_proxy_server.py for the NixlConnector). For each POST to /v1/completions or
/v1/chat/completions:

1. the next prefill instance (round robin) gets the request with max_tokens 1, stream false and
   kv_transfer_params {"do_remote_decode": true}: it computes the prompt's KV cache and keeps it
   for a decode instance to take; its answer carries kv_transfer_params saying where it is;
2. the next decode instance (its own round robin) gets the client's original request plus those
   kv_transfer_params, and its answer, JSON or a stream of server-sent events, goes back to the
   client as it is.

Errors an instance answers (a 400 for a bad request, say) reach the client unchanged; an instance
that cannot be reached is a 502 naming it. A client that goes away cancels the upstream request
in flight, so the instance sees the disconnect and aborts. GET /v1/models asks the first decode
instance; GET /health is 200 when every instance's /health is.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import signal
import threading
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Iterable, TypeVar
from urllib.parse import urlsplit

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 600.0      # seconds an upstream connect, read or write may take
HEALTH_TIMEOUT = 5.0         # seconds each instance's /health may take
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
FORWARDED_HEADERS = ("authorization", "x-request-id")
CLIENT_GONE = 499            # what we "answer" a client that has already left (nginx's code)

# The server's error shape (twostep.entrypoints.openai.errors.error_response); not imported from
# there, as that would load the engine into the proxy.
_ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 405: "MethodNotAllowedError",
                500: "InternalServerError", 502: "BadGatewayError", 503: "ServiceUnavailableError"}

T = TypeVar("T")


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": _ERROR_TYPES.get(status, "APIError"),
                      "param": param, "code": status}}
    return JSONResponse(body, status_code=status)


class ProxyError(Exception):
    """Answered to the client as an OpenAI-shaped error."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


def normalize_url(url: str) -> str:
    """An instance's base URL, scheme://host[:port]: a trailing / or /v1 is dropped."""
    parts = urlsplit(url.strip())
    path = parts.path.rstrip("/")
    path = path[:-len("/v1")] if path.endswith("/v1") else path
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"instance URL {url!r} needs a scheme and a host, e.g. http://10.0.0.1:8000")
    if path or parts.query or parts.fragment:
        raise ValueError(f"instance URL {url!r}: give the server's base URL, e.g. http://10.0.0.1:8000")
    parts.port  # noqa: B018 -- raises ValueError for a port that is not a number
    return f"{parts.scheme}://{parts.netloc}"


@dataclass(frozen=True)
class ProxyConfig:
    prefill_urls: tuple[str, ...]
    decode_urls: tuple[str, ...]
    timeout: float = DEFAULT_TIMEOUT

    def __post_init__(self) -> None:
        for role in ("prefill", "decode"):
            urls = getattr(self, f"{role}_urls")
            urls = (urls,) if isinstance(urls, str) else tuple(urls)
            if not urls:
                raise ValueError(f"no {role} instances: give at least one --{role} URL")
            object.__setattr__(self, f"{role}_urls", tuple(normalize_url(u) for u in urls))
        if not self.timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {self.timeout}")


class RoundRobin:
    """Hands out a fixed list's items in turn (one event loop: no lock needed)."""

    def __init__(self, items: Iterable[str]) -> None:
        self._cycle = itertools.cycle(tuple(items))

    def next(self) -> str:
        return next(self._cycle)


@dataclass
class ProxyState:
    config: ProxyConfig
    prefill: RoundRobin
    decode: RoundRobin
    client: httpx.AsyncClient | None = None      # made in the app's lifespan


# ---- the app ---------------------------------------------------------------------------------

def build_proxy_app(config: ProxyConfig) -> FastAPI:
    state = ProxyState(config, RoundRobin(config.prefill_urls), RoundRobin(config.decode_urls))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        # No cap on connections: every client request holds one upstream connection at a time.
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        async with httpx.AsyncClient(timeout=config.timeout, limits=limits) as client:
            state.client = client
            yield

    app = FastAPI(title="twostep disaggregation proxy", lifespan=lifespan,
                  docs_url=None, redoc_url=None, openapi_url=None)
    app.state.proxy = state

    @app.exception_handler(ProxyError)
    async def proxy_error(request: Request, exc: ProxyError):
        return error_response(exc.status, exc.message)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail))

    @app.post(COMPLETIONS)
    async def completions(request: Request):
        return await disaggregate(state, request, COMPLETIONS)

    @app.post(CHAT)
    async def chat(request: Request):
        return await disaggregate(state, request, CHAT)

    @app.get("/v1/models")
    async def models(request: Request):
        url = config.decode_urls[0]
        resp = await _upstream(request, "decode", url, state.client.get(
            url + "/v1/models", headers=forwarded_headers(request)))
        return passthrough(resp)

    @app.get("/health")
    async def health():
        return await _health(state)

    return app


async def disaggregate(state: ProxyState, request: Request, path: str) -> Response:
    """Prefill on one instance, decode on another; the decode instance's answer goes back."""
    body = await _json_object(request)
    headers = forwarded_headers(request)
    prefill_url = state.prefill.next()
    prefilled = await _upstream(request, "prefill", prefill_url, state.client.post(
        prefill_url + path, json=prefill_body(body, chat=path == CHAT), headers=headers))
    if prefilled is None:
        return Response(status_code=CLIENT_GONE)
    if not prefilled.is_success:
        return passthrough(prefilled)
    decode_body = {**body, "kv_transfer_params": _kv_transfer_params(prefilled, prefill_url)}
    decode_url = state.decode.next()
    if body.get("stream"):
        return await _stream_decode(state.client, request, decode_url, path, decode_body, headers)
    decoded = await _upstream(request, "decode", decode_url, state.client.post(
        decode_url + path, json=decode_body, headers=headers))
    return Response(status_code=CLIENT_GONE) if decoded is None else passthrough(decoded)


def prefill_body(body: dict, chat: bool) -> dict:
    """What the prefill instance gets: the request, to make one token, whole, and keep the
    prompt's KV cache for a remote decode."""
    out = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens")}
    out.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
    if chat and body.get("max_completion_tokens") is not None:   # it wins over max_tokens
        out["max_completion_tokens"] = 1
    return out


def forwarded_headers(request: Request) -> dict[str, str]:
    return {name: request.headers[name] for name in FORWARDED_HEADERS if name in request.headers}


def passthrough(resp: httpx.Response) -> Response:
    """An instance's whole answer, status and body as it sent them."""
    headers = {"retry-after": resp.headers["retry-after"]} if "retry-after" in resp.headers else None
    return Response(resp.content, status_code=resp.status_code, headers=headers,
                    media_type=resp.headers.get("content-type"))


async def _json_object(request: Request) -> dict:
    try:
        body = json.loads(await request.body())
    except ValueError:
        raise ProxyError(400, "the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise ProxyError(400, "the request body must be a JSON object")
    return body


def _kv_transfer_params(resp: httpx.Response, url: str) -> dict:
    try:
        answer = resp.json()
    except ValueError:
        raise ProxyError(502, f"prefill instance {url} answered with a body that is not JSON") from None
    params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
    if not isinstance(params, dict):
        raise ProxyError(502, f"prefill instance {url} returned no kv_transfer_params (is it started "
                              "with --kv-transfer-config and kv_role kv_producer?)")
    return params


async def _upstream(request: Request, role: str, url: str, call: Awaitable[T]) -> T | None:
    """The upstream call's result, None if the client left first (the call is then cancelled,
    which closes its connection); an instance that cannot be reached is a 502."""
    try:
        return await unless_client_leaves(request, call)
    except httpx.TransportError as exc:
        what = "did not answer in time" if isinstance(exc, httpx.TimeoutException) else "is unreachable"
        raise ProxyError(502, f"{role} instance {url} {what}: {type(exc).__name__}: {exc}") from exc


async def unless_client_leaves(request: Request, call: Awaitable[T], every: float = 0.1) -> T | None:
    """call's result, or None if the client disconnects first (call is then cancelled)."""
    task = asyncio.ensure_future(call)

    async def client_leaves() -> None:
        while not await request.is_disconnected():
            await asyncio.sleep(every)

    watcher = asyncio.ensure_future(client_leaves())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, watcher):
            t.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    return None if task.cancelled() else task.result()


async def _stream_decode(client: httpx.AsyncClient, request: Request, url: str, path: str,
                         body: dict, headers: dict[str, str]) -> Response:
    resp = await _upstream(request, "decode", url, client.send(
        client.build_request("POST", url + path, json=body, headers=headers), stream=True))
    if resp is None:
        return Response(status_code=CLIENT_GONE)
    if not resp.is_success:          # an error answer is one JSON body, not a stream
        try:
            await resp.aread()
        finally:
            await resp.aclose()
        return passthrough(resp)
    # The body generator closes the upstream response when it ends or is cancelled (the client
    # left); the background task closes it too in case the generator never ran.
    return StreamingResponse(_relay(resp, url), status_code=resp.status_code,
                             media_type="text/event-stream", background=BackgroundTask(resp.aclose))


async def _relay(resp: httpx.Response, url: str) -> AsyncIterator[bytes]:
    try:
        async for chunk in resp.aiter_bytes():
            yield chunk
    except httpx.HTTPError as exc:   # the instance broke off: end with an error event
        logger.warning("decode instance %s broke off a stream: %s: %s", url, type(exc).__name__, exc)
        error = {"error": {"message": f"decode instance {url} broke off the stream: {exc}",
                           "type": _ERROR_TYPES[502], "param": None, "code": 502}}
        yield f"data: {json.dumps(error)}\n\n".encode()
    finally:
        await resp.aclose()


async def _health(state: ProxyState) -> Response:
    instances = [("prefill", u) for u in state.config.prefill_urls] + \
                [("decode", u) for u in state.config.decode_urls]
    instances = list(dict.fromkeys(instances))
    timeout = min(state.config.timeout, HEALTH_TIMEOUT)

    async def problem(url: str) -> str | None:
        try:
            resp = await state.client.get(url + "/health", timeout=timeout)
        except httpx.HTTPError as exc:
            return f"unreachable: {type(exc).__name__}"
        return None if resp.status_code == 200 else f"status {resp.status_code}"

    problems = await asyncio.gather(*(problem(url) for _, url in instances))
    bad = [f"{role} {url} ({why})" for (role, url), why in zip(instances, problems) if why]
    if bad:
        return error_response(503, "unhealthy instances: " + ", ".join(bad))
    return PlainTextResponse("")


# ---- running it ------------------------------------------------------------------------------

class _QuietSignalsServer(uvicorn.Server):
    """uvicorn.Server that returns after its graceful shutdown on SIGINT/SIGTERM (uvicorn itself
    re-raises the signal then, which would end the process with it instead of exit 0)."""

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def run_proxy(prefill_urls: Iterable[str], decode_urls: Iterable[str], host: str, port: int,
              log_level: str = "info", timeout: float = DEFAULT_TIMEOUT) -> int:
    config = ProxyConfig(prefill_urls, decode_urls, timeout)   # it checks and normalises the URLs
    app = build_proxy_app(config)
    logger.info("disaggregation proxy on http://%s:%d: prefill on %s, decode on %s", host, port,
                ", ".join(config.prefill_urls), ", ".join(config.decode_urls))
    server = _QuietSignalsServer(uvicorn.Config(app, host=host, port=port, log_level=log_level.lower()))
    server.run()
    return 0
