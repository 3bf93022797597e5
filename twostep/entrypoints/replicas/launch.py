"""`twostep serve --data-parallel-size N` (or --ray-address, --min/--max-replicas, --prefill/--decode-
replicas): the engine replicas as a Ray Serve application on a Ray cluster, the front (front.py) in
this process on --host:--port. Ray Serve runs no HTTP proxy of its own: the front is the only way in.
SIGINT/SIGTERM: the front finishes its in-flight requests for the grace period, then the application
is deleted (each replica aborts what it still runs) and a cluster this process started stops.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import socket
import threading
import time

from twostep.config import EngineConfig, KVTransferConfig
from twostep.config.replicas import ReplicaConfig
from twostep.entrypoints.openai.server import serve_app
from twostep.entrypoints.openai.state import QUEUED_PER_RUNNING, ServerConfig
from twostep.entrypoints.replicas.front import Pool, build_front
from twostep.entrypoints.replicas.replica import EngineReplica
from twostep.entrypoints.replicas.router import TwostepRouter

logger = logging.getLogger(__name__)

DELETE_TIMEOUT_S = 60.0      # replicas get their graceful shutdown (10 s) and some


def import_ray():
    try:
        import ray
        from ray import serve
    except ImportError as e:
        raise ValueError("replicas run on Ray Serve, which is not installed: pip install 'twostep[ray]' "
                         "(or 'ray[serve]')") from e
    return ray, serve


def run_replicas(engine_config: EngineConfig, server_config: ServerConfig, replicas: ReplicaConfig,
                 host: str, port: int, log_level: str = "info", graceful_timeout: float = 5.0) -> int:
    ray, serve = import_ray()
    if server_config.max_queued_requests is None:
        server_config = dataclasses.replace(server_config,
                                            max_queued_requests=QUEUED_PER_RUNNING * engine_config.max_num_seqs)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    started_here = replicas.ray_address is None
    logger.info("Ray: %s", "starting a local cluster" if started_here else f"joining {replicas.ray_address}")
    ray.init(address=replicas.ray_address or "local", namespace="twostep", logging_level=logging.WARNING,
             log_to_driver=True)
    apps: list[str] = []
    try:
        _check_resources(ray, engine_config, replicas)
        serve.start(proxy_location="Disabled")
        began = time.monotonic()
        # one application per front: named by its port and host (fronts on one cluster must differ)
        pools = _deploy(serve, f"twostep-{port}-{socket.gethostname()}", engine_config, server_config, replicas, apps)
        logger.info("%s ready in %.1f s", _describe(replicas), time.monotonic() - began)
        front = build_front(pools, server_config)
        ending: set[asyncio.Task] = set()      # the shutdown's abort, held until it is done

        def abort_all() -> None:
            task = asyncio.ensure_future(front.state.front.abort_all())
            ending.add(task)
            task.add_done_callback(ending.discard)

        return serve_app(front, host, port, log_level, graceful_timeout, abort_all=abort_all)
    finally:
        logger.info("stopping the replicas")
        if not started_here:    # they live on a cluster that outlives this process: delete them
            _within(DELETE_TIMEOUT_S, lambda: [serve.delete(app) for app in apps], "deleting the replicas")
        # a cluster this process started stops with it, replicas included (its processes share this
        # one's process group: a Ctrl-C or a group's SIGTERM may have stopped them already, which
        # would leave a Serve call waiting forever)
        ray.shutdown()


def _within(seconds: float, work, what: str) -> None:
    """work() in a thread, given up after seconds (a cluster that stopped answering)."""
    done = threading.Thread(target=work, name=what, daemon=True)
    done.start()
    done.join(seconds)
    if done.is_alive():
        logger.warning("%s: no answer from the Ray cluster in %.0f s; leaving it", what, seconds)


def _deploy(serve, name: str, engine_config: EngineConfig, server_config: ServerConfig,
            replicas: ReplicaConfig, apps: list[str]) -> dict[str, Pool]:
    """The replicas as Ray Serve applications: one ("engine"), or a "prefill" and a "decode" pool."""
    from ray.serve.config import RequestRouterConfig

    def pool(role: str, config: EngineConfig, **scale) -> Pool:
        deployment = serve.deployment(EngineReplica, name=role).options(
            ray_actor_options={"num_cpus": replicas.replica_cpus * config.tensor_parallel_size},
            # the engine's own queue answers 503 past --max-queued-requests: Ray must not queue before it
            max_ongoing_requests=config.max_num_seqs + server_config.max_queued_requests + 16,
            request_router_config=RequestRouterConfig(
                request_router_class=TwostepRouter,
                request_router_kwargs={"policy": replicas.routing_policy, "imbalance": replicas.routing_imbalance}),
            health_check_period_s=2.0, health_check_timeout_s=30.0, graceful_shutdown_timeout_s=10.0, **scale)
        app = f"{name}-{role}"
        apps.append(app)
        handle = serve.run(deployment.bind(config, server_config), name=app, route_prefix=None)
        return Pool(role, handle, may_be_empty=scale.get("autoscaling_config", {}).get("min_replicas", 1) == 0)

    config = dataclasses.replace(engine_config, num_threads=engine_config.num_threads
                                 or max(1, int(replicas.replica_cpus)))
    if replicas.disaggregated:
        kv = config.kv_transfer_config or KVTransferConfig()
        return {"prefill": pool("prefill", _with_role(config, kv, "kv_producer"), num_replicas=replicas.prefill_replicas),
                "decode": pool("decode", _with_role(config, kv, "kv_consumer"), num_replicas=replicas.decode_replicas)}
    if replicas.autoscaling:
        return {"engine": pool("engine", config, autoscaling_config={
            "min_replicas": replicas.min_replicas, "max_replicas": replicas.max_replicas,
            "initial_replicas": max(replicas.min_replicas, 1),
            "target_ongoing_requests": replicas.target_ongoing_requests or engine_config.max_num_seqs,
            "upscale_delay_s": 5.0, "downscale_delay_s": 60.0})}
    return {"engine": pool("engine", config, num_replicas=replicas.data_parallel_size)}


def _with_role(config: EngineConfig, kv: KVTransferConfig, role: str) -> EngineConfig:
    return dataclasses.replace(config, kv_transfer_config=dataclasses.replace(kv, kv_role=role))


def _check_resources(ray, engine_config: EngineConfig, replicas: ReplicaConfig) -> None:
    """Refuse a start that can never place its replicas (each waits for its CPUs forever)."""
    count = (replicas.prefill_replicas + replicas.decode_replicas if replicas.disaggregated
             else replicas.min_replicas if replicas.autoscaling else replicas.data_parallel_size)
    need = count * replicas.replica_cpus * engine_config.tensor_parallel_size
    have = ray.cluster_resources().get("CPU", 0)
    if need > have:
        raise ValueError(f"{_describe(replicas)} need {need:g} CPUs (--replica-cpus {replicas.replica_cpus:g} x "
                         f"--tensor-parallel-size {engine_config.tensor_parallel_size} each) and the Ray cluster "
                         f"has {have:g}: lower --replica-cpus or add nodes (`ray start --address ...`)")
    if replicas.autoscaling and replicas.max_replicas * replicas.replica_cpus * engine_config.tensor_parallel_size > have:
        logger.warning("--max-replicas %d needs more CPUs than the cluster's %g: scaling stops where they run out",
                       replicas.max_replicas, have)


def _describe(replicas: ReplicaConfig) -> str:
    if replicas.disaggregated:
        return f"{replicas.prefill_replicas} prefill + {replicas.decode_replicas} decode replicas"
    if replicas.autoscaling:
        return f"{replicas.min_replicas}-{replicas.max_replicas} replicas (autoscaling)"
    return f"{replicas.data_parallel_size} replica{'s' * (replicas.data_parallel_size > 1)}"
