"""The one OpenAI endpoint in front of the replicas: an ASGI app in the `twostep serve` process.

Every route is the replicas' (each runs the single server's app, replica.py): the front checks the API
key and the body's size, asks the router where the request goes (router.py: it reads the prompt's
routing text), hands the request over a Ray DeploymentHandle and streams the answer back with the
routing decision in its headers (x-twostep-replica, x-twostep-routing, x-twostep-prefix-match). A
client that goes away cancels the call, and the replica's route aborts its engine requests.

A replica that dies: a request it had not answered gets a 503 (Retry-After), a stream it was sending
ends with an error event (and `data: [DONE]` where the API has one); the router stops sending to it,
and Ray starts another. /health: 200 while a replica lives. /metrics: every replica's, labelled.

With a prefill and a decode pool (disaggregation), completions and chat are prefilled on a prefill
replica (one token, the prompt's KV blocks kept for a consumer: disagg_proxy.prefill_body), then
decoded on a decode replica that pulls those blocks; the other routes go to the decode pool.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import re
import time
from collections import OrderedDict
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from twostep.entrypoints.openai.disagg_proxy import CHAT, CLIENT_GONE, COMPLETIONS, prefill_body, unless_client_leaves
from twostep.entrypoints.openai.errors import anthropic_error_body, error_response, error_response_for, speaks_anthropic
from twostep.entrypoints.openai.middleware import BodySizeLimit, RequireAPIKey
from twostep.entrypoints.openai.state import ServerConfig
from twostep.entrypoints.replicas.asgi_call import ForwardedRequest, ResponseStart
from twostep.entrypoints.replicas.front_metrics import FrontMetrics
from twostep.entrypoints.replicas.router import RouteTicket
from twostep.entrypoints.replicas.routing_text import json_object, previous_response_id, routing_text

logger = logging.getLogger(__name__)

METHODS = ["GET", "POST", "DELETE"]
_HOP_HEADERS = {"host", "content-length", "transfer-encoding", "connection", "authorization", "x-api-key",
                "keep-alive", "upgrade"}
_RESPONSE_ID = re.compile(rb'"id"\s*:\s*"(resp_[A-Za-z0-9_-]+)"')
_STORED = re.compile(r"^/v1/responses/([^/]+)")
METRICS_TIMEOUT = 5.0
LIVE_CACHE_S = 1.0           # how long a pool's count of live replicas is trusted
OWNERS_PER_STORED = 8        # stored responses remembered: this many replicas' worth


class ReplicaGone(Exception):
    """The replica died or could not be reached before it answered."""


class Pool:
    """A deployment of replicas, by its DeploymentHandle. may_be_empty: it scales from zero replicas
    (requests then wait for Ray Serve to start one instead of getting a 503)."""

    def __init__(self, name: str, handle: Any, may_be_empty: bool = False) -> None:
        self.name, self.handle, self.may_be_empty = name, handle, may_be_empty
        self.streaming = handle.options(stream=True)
        self._live, self._live_at = 0, -LIVE_CACHE_S

    async def ask_all(self, method: str) -> dict[str, Any]:
        """Every running replica's answer to method() -> (replica id, answer); {} when the pool has no
        replica or they do not all answer within METRICS_TIMEOUT."""
        try:
            results = await self.handle.broadcast(method).results_async(timeout_s=METRICS_TIMEOUT,
                                                                        return_exceptions=True)
        except Exception as e:        # noqa: BLE001 -- Ray's: no replica (DeploymentUnavailableError), timeout
            logger.warning("%s pool: %s() on every replica: %s: %s", self.name, method, type(e).__name__, e)
            return {}
        return dict(r for r in results if isinstance(r, tuple))

    async def live(self) -> int:
        """Replicas whose engine runs (asked at most every LIVE_CACHE_S)."""
        now = time.monotonic()
        if now - self._live_at >= LIVE_CACHE_S:
            self._live, self._live_at = sum((await self.ask_all("ping")).values()), now
        return self._live


class Front:
    def __init__(self, pools: dict[str, Pool], config: ServerConfig) -> None:
        self.pools, self.config = pools, config
        self.main = pools.get("engine") or pools["decode"]      # where every route goes
        self.prefill = pools.get("prefill")
        self.metrics = FrontMetrics()
        self.owners: OrderedDict[str, str] = OrderedDict()    # stored response id -> its replica

    # ---- one request, to one replica -------------------------------------------------------------

    async def call(self, pool: Pool, ticket: RouteTicket, request: ForwardedRequest, count: bool = True):
        """(ResponseStart, the rest of the answer) from the pool's replica the router picks; counted in
        the router's metrics unless count is False (a /metrics scrape)."""
        from ray.exceptions import RayError

        if not pool.may_be_empty and not await pool.live():
            raise ReplicaGone(f"no {pool.name} replica is running (Ray is starting one)")
        answer = pool.streaming.forward.remote(ticket, request)
        try:
            start = await answer.__anext__()
        except asyncio.CancelledError:   # the client left: the replica's route aborts its requests
            answer.cancel()
            raise
        except (RayError, StopAsyncIteration) as e:
            answer.cancel()
            raise ReplicaGone(f"replica {ticket.replica or '?'} failed before it answered: "
                              f"{type(e).__name__}") from e
        if count:
            self.metrics.routed.labels(start.replica, ticket.decision or "unrouted").inc()
            self.metrics.match.observe(ticket.match.ratio)
        return start, answer

    async def forward(self, request: Request) -> Response:
        path, body = request.url.path, await request.body()
        data = json_object(body) if request.method == "POST" else {}
        text = routing_text(data)
        headers = tuple((k, v) for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS)
        ticket = RouteTicket(text, pin=self._owner(path, data))
        try:     # a non-streamed answer comes whole: a client that leaves first cancels it
            answered = await unless_client_leaves(request, self._answer(ticket, path, data, ForwardedRequest(
                request.method, path, request.url.query, headers, body)))
        except ReplicaGone as e:
            self.metrics.failures.inc()
            logger.warning("%s %s: %s", request.method, path, e)
            return error_response_for(path, 503, f"{e}; retry", retry_after=1)
        if answered is None:
            return Response(status_code=CLIENT_GONE)
        if isinstance(answered, Response):
            return answered
        start, answer = answered
        out_headers = {k: v for k, v in start.headers if k.lower() not in _HOP_HEADERS}
        out_headers |= {"x-twostep-replica": start.replica, "x-twostep-routing": ticket.decision,
                        "x-twostep-prefix-match": f"{ticket.match.ratio:.3f}"}
        stores = path == "/v1/responses" and request.method == "POST" and data.get("store", True) is not False
        return StreamingResponse(self._body(answer, start, path, stores), status_code=start.status,
                                 headers=out_headers)

    async def _answer(self, ticket: RouteTicket, path: str, data: dict, request: ForwardedRequest):
        """(ResponseStart, the rest) from the main pool, after the prefill pool where there is one;
        or the prefill replica's error as it is."""
        if self.prefill is not None and path in (COMPLETIONS, CHAT) and data:
            prefilled = await self._prefill(path, data, ticket.text, request.headers)
            if isinstance(prefilled, Response):
                return prefilled
            request = dataclasses.replace(request, body=json.dumps({**data, "kv_transfer_params": prefilled}).encode())
        return await self.call(self.main, ticket, request)

    async def _prefill(self, path: str, data: dict, text: str, headers) -> dict | Response:
        """The prompt prefilled on a prefill replica: its kv_transfer_params, or its error as it is."""
        from ray.exceptions import RayError

        request = ForwardedRequest("POST", path, "", headers, json.dumps(prefill_body(data, path == CHAT)).encode())
        start, answer = await self.call(self.prefill, RouteTicket(text), request)
        try:
            body = b"".join([chunk async for chunk in answer])
        except RayError as e:
            raise ReplicaGone(f"prefill replica {start.replica} failed: {type(e).__name__}") from e
        finally:
            answer.cancel()          # no-op once answered; the client left: the prefill is aborted
        if start.status != 200:
            return Response(body, status_code=start.status, media_type="application/json")
        params = json_object(body).get("kv_transfer_params")
        if not isinstance(params, dict):
            return error_response_for(path, 502, f"prefill replica {start.replica} returned no kv_transfer_params")
        return params

    async def _body(self, answer, start: ResponseStart, path: str, stores: bool):
        from ray.exceptions import RayError

        is_stream = (start.header("content-type") or "").startswith("text/event-stream")
        seen = b""
        try:
            async for chunk in answer:
                if stores and len(seen) < 65536:
                    seen += chunk
                    if (found := _RESPONSE_ID.search(seen)) is not None:
                        self._own(found.group(1).decode(), start.replica)
                        stores = False
                yield chunk
        except RayError as e:
            self.metrics.failures.inc()
            message = f"replica {start.replica} failed while answering ({type(e).__name__}); retry"
            logger.warning("%s: %s", path, message)
            if not is_stream:
                raise        # a body cut short: the connection is dropped, not a truncated 200
            yield stream_error_tail(path, message)
        finally:
            answer.cancel()        # the client went away: the replica's route aborts its requests

    # ---- stored responses live on the replica that made them ------------------------------------

    def _owner(self, path: str, data: dict) -> str | None:
        stored = _STORED.match(path)
        rid = stored.group(1) if stored else previous_response_id(data)
        return self.owners.get(rid) if rid else None

    def _own(self, response_id: str, replica: str) -> None:
        self.owners[response_id] = replica
        self.owners.move_to_end(response_id)
        while len(self.owners) > OWNERS_PER_STORED * max(1, self.config.max_stored_responses):
            self.owners.popitem(last=False)

    async def connect(self) -> None:
        """A first call through each pool: its handle starts its router, which learns the replicas."""
        for name, pool in self.pools.items():
            start, answer = await self.call(pool, RouteTicket(), ForwardedRequest("GET", "/health"), count=False)
            async for _ in answer:
                pass
            logger.info("%s pool: %d replicas", name, await pool.live())

    # ---- /metrics, /health ------------------------------------------------------------------------

    async def render_metrics(self) -> bytes:
        texts: dict[str, str] = {}
        for pool in self.pools.values():
            texts |= await pool.ask_all("metrics")
        self.metrics.replicas.set(len(texts))
        return self.metrics.render(texts)

    async def abort_all(self) -> None:
        """Every replica ends what it runs (the streams end properly, finish_reason abort)."""
        for pool in self.pools.values():
            await pool.ask_all("abort_all")

    async def missing_pools(self) -> list[str]:
        """The pools without a live replica."""
        return [name for name, pool in self.pools.items() if not await pool.live()]


def stream_error_tail(path: str, message: str) -> bytes:
    """The end of a stream whose replica failed, in its API's shape."""
    if speaks_anthropic(path):
        _, body = anthropic_error_body(503, message)
        return f"event: error\ndata: {json.dumps(body)}\n\n".encode()
    if path.startswith("/v1/responses"):
        event = {"type": "error", "code": "server_error", "message": message, "param": None}
        return f"event: error\ndata: {json.dumps(event)}\n\n".encode()
    error = {"message": message, "type": "ServiceUnavailableError", "param": None, "code": 503}
    return f"data: {json.dumps({'error': error})}\n\ndata: [DONE]\n\n".encode()


def build_front(pools: dict[str, Pool], config: ServerConfig) -> FastAPI:
    front = Front(pools, config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await front.connect()
        yield

    app = FastAPI(title="twostep (replicas)", openapi_url=None, docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.front = front
    app.state.api_key = config.api_key
    if config.api_key:
        app.add_middleware(RequireAPIKey, api_key=config.api_key,
                           open_paths={"/health"} | (set() if config.metrics_need_key else {"/metrics"}))
    app.add_middleware(BodySizeLimit, max_bytes=config.max_request_body_bytes)

    @app.get("/health")
    async def health():
        empty = await front.missing_pools()
        if not empty:
            return Response(status_code=200)
        return error_response(503, f"no {' or '.join(empty)} replica is running", retry_after=1)

    @app.get("/metrics")
    async def metrics():
        return Response(await front.render_metrics(), media_type="text/plain; version=0.0.4")

    @app.api_route("/{path:path}", methods=METHODS)
    async def forward(request: Request):
        return await front.forward(request)

    return app
