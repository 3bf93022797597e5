"""One engine replica: an LLMEngine and the very OpenAI app `twostep serve` runs, in a Ray Serve replica.

The front (front.py) hands it whole HTTP requests through a DeploymentHandle; the app answers them in
this process (asgi_call.py), so every route, check and error is the single server's. The replica's
own API key and body limit are left to the front, the only way in.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncIterator

from twostep.config import EngineConfig
from twostep.engine.llm_engine import LLMEngine
from twostep.entrypoints.openai.server import build_app
from twostep.entrypoints.openai.state import ServerConfig
from twostep.entrypoints.replicas.asgi_call import ForwardedRequest, ResponseStart, call_app

logger = logging.getLogger(__name__)


class EngineReplica:
    async def __init__(self, engine_config: EngineConfig, server_config: ServerConfig) -> None:  # type: ignore[misc]
        """Ray Serve awaits an async constructor: the replica takes requests once its engine runs."""
        from ray import serve
        from ray.util import get_node_ip_address

        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        transfer = engine_config.kv_transfer_config
        if transfer is not None:         # each replica serves its KV blocks on its own node and port
            transfer = dataclasses.replace(transfer, kv_ip=get_node_ip_address(), kv_port=0,
                                           engine_id=f"replica-{self.replica_id}")
            engine_config = dataclasses.replace(engine_config, kv_transfer_config=transfer)
        logger.info("replica %s: loading %s", self.replica_id, engine_config.model or "the default model")
        self.engine = LLMEngine(engine_config)
        self.app = build_app(self.engine, dataclasses.replace(server_config, api_key=None))
        self._lifespan = self.app.router.lifespan_context(self.app)
        await self._lifespan.__aenter__()          # the engine thread, on this replica's event loop
        logger.info("replica %s: serving", self.replica_id)

    async def forward(self, ticket, request: ForwardedRequest) -> AsyncIterator[ResponseStart | bytes]:
        """The app's answer to request (ticket: the front's routing, read by the router only)."""
        async for part in call_app(self.app, request, self.replica_id):
            yield part

    async def ping(self) -> tuple[str, bool]:
        """(this replica, whether its engine runs): the front's /health asks every replica."""
        return self.replica_id, self.app.state.twostep.engine.healthy

    async def metrics(self) -> tuple[str, str]:
        """(this replica, its /metrics text): the front asks every replica (a Ray Serve broadcast)."""
        parts = [part async for part in call_app(self.app, ForwardedRequest("GET", "/metrics"), self.replica_id)]
        return self.replica_id, b"".join(p for p in parts if isinstance(p, bytes)).decode()

    async def abort_all(self) -> None:
        """End every request in flight here (finish_reason abort): the front's shutdown past its grace."""
        self.app.state.twostep.engine.abort_all()

    async def check_health(self) -> None:
        """Ray Serve's health check: an engine whose loop died makes Ray replace the replica."""
        engine = self.app.state.twostep.engine
        if not engine.healthy:
            raise RuntimeError(f"replica {self.replica_id}: the engine stopped: {engine.error}")

    async def __del__(self) -> None:
        """Ray Serve's graceful shutdown: in-flight requests are aborted (their streams end properly)."""
        await self._lifespan.__aexit__(None, None, None)
