"""ZmqConnector: KV blocks pulled over pyzmq (ROUTER on the producer, one DEALER per producer on
the consumer), the way vLLM's NixlConnector pulls: the decode instance reads from the prefill
instance, which holds the blocks under a lease until they are read or the lease runs out.

Messages are a JSON header frame, then for a read's answer one byte frame per payload part
(blocks.py), sent and received without copies:

    handshake                        -> {layout, engine_id}   (a layout mismatch is refused)
    read {request_id, first_block, num_blocks} -> {ok} + parts | {ok: false, error}
    extend {request_id}              (no answer: the lease starts again)
    release {request_id}             (no answer: the producer may free the blocks)

Threads: the producer's server thread answers reads from the cache tensors (the leased blocks are
finished and nobody writes them); the consumer's loader thread does every network call and hands
what arrived to the engine thread, which writes it into the cache (write_loaded). Requests and the
block pool stay the scheduler's: it learns what ended from get_finished().
"""
from __future__ import annotations

import json
import logging
import queue
import threading
import time
import warnings
from dataclasses import dataclass

import torch
import zmq

from twostep.attention.kv_layer_cache import KVLayerCache
from twostep.config.kv_transfer import KVTransferConfig
from twostep.kv_transfer.blocks import CacheLayout, gather_blocks, payload_bytes
from twostep.kv_transfer.connector import BlockWriter, KVConnector, TransferEvents, TransferStats
from twostep.kv_transfer.params import RemotePrefill, producer_params

logger = logging.getLogger(__name__)
_POLL_MS = 100


@dataclass(slots=True)
class _Lease:
    block_ids: list[int]
    expires: float


@dataclass(slots=True)
class _Load:
    request_id: str
    remote: RemotePrefill
    first_block: int
    local_block_ids: list[int]
    started: float


@dataclass(slots=True)
class _Arrived:
    load: _Load
    parts: list[torch.Tensor] | None
    error: str | None = None


class ZmqConnector(KVConnector):
    def __init__(self, config: KVTransferConfig, caches: list[KVLayerCache]) -> None:
        self.config = config
        self.is_producer, self.is_consumer = config.is_producer, config.is_consumer
        self.failure_policy = config.kv_load_failure_policy
        self.lease_s, self.timeout_s = config.extra("lease_s"), config.extra("timeout_s")
        self.layout = CacheLayout.of(caches)
        self._caches = caches
        self._ctx = zmq.Context()
        self._lock = threading.Lock()
        self._progress = threading.Event()
        self._stopping = threading.Event()
        self._stats = TransferStats()
        self._events = TransferEvents()
        self._leases: dict[str, _Lease] = {}          # producer: blocks held for consumers
        self._loads: dict[str, _Load] = {}            # consumer: loads not yet written
        self._arrived: list[_Arrived] = []
        self._expected: dict[str, tuple[RemotePrefill, float]] = {}   # consumer: waiting, lease kept alive
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self.port = config.kv_port
        self.engine_id = config.engine_id or f"{config.kv_ip}:{config.kv_port}"
        if self.is_producer:
            server = self._ctx.socket(zmq.ROUTER)
            server.setsockopt(zmq.LINGER, 0)
            address = f"tcp://{config.kv_ip}"
            if config.kv_port:
                server.bind(f"{address}:{config.kv_port}")
            else:
                self.port = server.bind_to_random_port(address)
            self.engine_id = config.engine_id or f"{config.kv_ip}:{self.port}"
            self._start(self._serve, server, "twostep-kv-server")
            logger.info("KV transfer: serving finished prefills' blocks on tcp://%s:%d (lease %.0f s)",
                        config.kv_ip, self.port, self.lease_s)
        if self.is_consumer:
            self._start(self._load_loop, None, "twostep-kv-loader")
            logger.info("KV transfer: loading remote prefills (timeout %.0f s, on failure: %s)",
                        self.timeout_s, self.failure_policy)

    def _start(self, target, arg, name: str) -> None:
        thread = threading.Thread(target=target, args=(arg,) if arg is not None else (), name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    # ---- scheduler side ----------------------------------------------------------------------

    def start_load(self, request_id: str, remote: RemotePrefill, first_block: int,
                   local_block_ids: list[int]) -> None:
        load = _Load(request_id, remote, first_block, local_block_ids, time.monotonic())
        with self._lock:
            self._loads[request_id] = load
        self._expected.pop(request_id, None)
        self._jobs.put(("load", load))

    def cancel_load(self, request_id: str) -> None:
        with self._lock:
            load = self._loads.pop(request_id, None)
        if load is not None:
            self._jobs.put(("release", load.remote))

    def request_finished(self, request_id: str, prompt_token_ids: list[int], block_ids: list[int]) -> dict:
        block_ids = block_ids[:-(-len(prompt_token_ids) // self.layout.block_size)]   # the prompt's only
        with self._lock:
            self._leases[request_id] = _Lease(list(block_ids), time.monotonic() + self.lease_s)
        return producer_params(self.engine_id, self.config.kv_ip, self.port, request_id, block_ids,
                               prompt_token_ids, self.lease_s)

    def expect(self, request_id: str, remote: RemotePrefill) -> None:
        self._expected[request_id] = (remote, time.monotonic())

    def forget(self, request_id: str) -> None:
        """The request ended before its load started: the producer may free its blocks now."""
        expected = self._expected.pop(request_id, None)
        if expected is not None:
            self._jobs.put(("release", expected[0]))

    def get_finished(self) -> TransferEvents:
        now = time.monotonic()
        for rid, (remote, touched) in list(self._expected.items()):
            if now - touched > remote.lease_s / 3:
                self._jobs.put(("extend", remote))
                self._expected[rid] = (remote, now)
        with self._lock:
            events, self._events = self._events, TransferEvents()
        return events

    # ---- worker side ---------------------------------------------------------------------------

    def write_loaded(self, write: BlockWriter) -> None:
        with self._lock:
            arrived, self._arrived = self._arrived, []
        for item in arrived:
            load = item.load
            with self._lock:
                if self._loads.get(load.request_id) is not load:
                    continue                         # cancelled meanwhile: its blocks are not ours
                del self._loads[load.request_id]
            error = item.error
            if error is None:
                try:
                    write(load.local_block_ids, item.parts)
                except ValueError as e:
                    error = f"KV blocks from {load.remote.address} do not fit this cache: {e}"
            with self._lock:
                self._stats.load_seconds += time.monotonic() - load.started
                if error is None:
                    size = payload_bytes(item.parts)
                    self._stats.num_loads += 1
                    self._stats.bytes_received += size
                    self._events.finished_recving[load.request_id] = size
                else:
                    self._stats.num_load_failures += 1
                    self._events.failed_recving[load.request_id] = error
            if error is not None:
                logger.warning("request %s: %s", load.request_id, error)

    def wait(self, timeout: float) -> None:
        self._progress.wait(timeout)
        self._progress.clear()

    @property
    def has_pending(self) -> bool:
        with self._lock:
            return bool(self._leases or self._loads)

    def stats(self) -> dict:
        with self._lock:
            return self._stats.as_dict()

    def close(self) -> None:
        self._stopping.set()
        self._jobs.put(None)
        for thread in self._threads:
            thread.join(timeout=self.timeout_s + 1)
        if not any(t.is_alive() for t in self._threads):   # each closed its own sockets
            self._ctx.term()

    # ---- producer: the server thread -----------------------------------------------------------

    def _serve(self, server: zmq.Socket) -> None:
        try:
            while not self._stopping.is_set():
                if server.poll(_POLL_MS):
                    frames = server.recv_multipart()
                    reply = self._answer_safely(frames[1]) if len(frames) > 1 else None
                    if reply is not None:
                        server.send_multipart([frames[0], *reply], copy=False)
                self._expire_leases()
        finally:
            server.close(linger=0)

    def _answer_safely(self, raw: bytes) -> list | None:
        """A message from anyone: whatever it holds, the answer is an error, never a dead thread."""
        try:
            return self._answer(_decode(raw))
        except Exception as e:  # noqa: BLE001 - the server thread must outlive any message
            logger.warning("KV transfer: bad message refused: %s: %s", type(e).__name__, e)
            return [_encode({"ok": False, "error": f"bad message: {type(e).__name__}: {e}"})]

    def _answer(self, msg: dict) -> list | None:
        op, rid = msg.get("op"), msg.get("request_id")
        if op != "handshake" and not isinstance(rid, str):
            return [_encode({"ok": False, "error": "request_id must be a string"})]
        if op == "handshake":
            return [_encode({"ok": True, "layout": self.layout.as_dict(), "engine_id": self.engine_id})]
        with self._lock:
            lease = self._leases.get(rid)
            if op == "release":
                if self._leases.pop(rid, None) is not None:
                    self._events.finished_sending.append(rid)
                return None
            if lease is not None:
                lease.expires = time.monotonic() + self.lease_s
        if op == "extend":
            return None
        if op != "read":
            return [_encode({"ok": False, "error": f"unknown operation {op!r}"})]
        if lease is None:
            return [_encode({"ok": False, "error": f"no KV blocks held for request {rid!r} on {self.engine_id} "
                                                   "(never prefilled here, already read, or its lease expired)"})]
        first, count = msg.get("first_block", 0), msg.get("num_blocks", 0)
        if not (isinstance(first, int) and isinstance(count, int) and 0 <= first and count >= 0
                and first + count <= len(lease.block_ids)):
            return [_encode({"ok": False, "error": f"blocks {first}..{first}+{count} are outside request "
                                                   f"{rid!r}'s {len(lease.block_ids)} blocks"})]
        parts = gather_blocks(self._caches, lease.block_ids[first:first + count])
        with self._lock:
            self._stats.bytes_sent += payload_bytes(parts)
        return [_encode({"ok": True}), *(p.numpy() for p in parts)]

    def _expire_leases(self) -> None:
        now = time.monotonic()
        with self._lock:
            expired = [rid for rid, lease in self._leases.items() if lease.expires <= now]
            for rid in expired:
                del self._leases[rid]
                self._events.finished_sending.append(rid)
                self._stats.num_leases_expired += 1
        for rid in expired:
            logger.warning("KV blocks of request %s were not claimed within the %.0f s lease; freeing them",
                           rid, self.lease_s)

    # ---- consumer: the loader thread -----------------------------------------------------------

    def _load_loop(self) -> None:
        peers = _Peers(self._ctx, self.layout, self.timeout_s)
        try:
            while True:
                job = self._jobs.get()
                if job is None:
                    return
                try:
                    if job[0] == "load":
                        self._load(peers, job[1])
                    else:                                # extend or release the producer's lease
                        op, remote = job
                        peers.send(remote.address, {"op": op, "request_id": remote.request_id})
                except Exception as e:  # noqa: BLE001 - the loader must outlive any one job
                    logger.warning("KV transfer: %s job failed: %s: %s", job[0], type(e).__name__, e)
                    if job[0] == "load":
                        self._arrive(_Arrived(job[1], None, f"KV transfer from {job[1].remote.address} "
                                                            f"failed: {type(e).__name__}: {e}"))
        finally:
            peers.close()

    def _load(self, peers: "_Peers", load: _Load) -> None:
        with self._lock:
            active = self._loads.get(load.request_id) is load
        if not active:
            return
        remote = load.remote
        count = len(load.local_block_ids)
        try:
            parts = peers.read(remote, load.first_block, count)
            arrived = _Arrived(load, parts)
        except _TransferError as e:
            arrived = _Arrived(load, None, str(e))
        peers.send(remote.address, {"op": "release", "request_id": remote.request_id})
        self._arrive(arrived)

    def _arrive(self, arrived: _Arrived) -> None:
        with self._lock:
            self._arrived.append(arrived)
        self._progress.set()


class _TransferError(Exception):
    pass


class _Peers:
    """The consumer's sockets, one per producer, owned by the loader thread. A socket that timed
    out is dropped, so a late answer never meets the next question."""

    def __init__(self, ctx: zmq.Context, layout: CacheLayout, timeout_s: float) -> None:
        self._ctx, self._layout, self._timeout_ms = ctx, layout, int(timeout_s * 1000)
        self._sockets: dict[str, zmq.Socket] = {}
        self._checked: set[str] = set()          # producers whose layout matched ours

    def read(self, remote: RemotePrefill, first_block: int, num_blocks: int) -> list[torch.Tensor]:
        address = remote.address
        if address not in self._checked:
            self._handshake(address)
        frames = self._ask(address, {"op": "read", "request_id": remote.request_id,
                                     "first_block": first_block, "num_blocks": num_blocks})
        header = _decode(frames[0].bytes)
        if not header.get("ok"):
            raise _TransferError(f"KV transfer from {address} refused: {header.get('error')}")
        with warnings.catch_warnings():     # read-only zmq buffers: only ever copied from
            warnings.simplefilter("ignore", UserWarning)
            return [torch.frombuffer(f.buffer, dtype=torch.uint8) if len(f.buffer) else
                    torch.empty(0, dtype=torch.uint8) for f in frames[1:]]

    def send(self, address: str, msg: dict) -> None:
        """A message without an answer (extend, release); zmq queues it until connected, and one
        that cannot be queued (a producer long gone) is dropped rather than waited for."""
        try:
            self._socket(address).send(_encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            logger.warning("KV transfer: %s to %s dropped (no connection)", msg.get("op"), address)

    def close(self) -> None:
        for sock in self._sockets.values():
            sock.close(linger=0)

    def _socket(self, address: str) -> zmq.Socket:
        if address not in self._sockets:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(address)
            self._sockets[address] = sock
        return self._sockets[address]

    def _handshake(self, address: str) -> None:
        header = _decode(self._ask(address, {"op": "handshake"})[0].bytes)
        problems = self._layout.mismatches(header.get("layout", {}))
        if problems:
            self._drop(address)
            raise _TransferError(f"KV cache layout of {header.get('engine_id', address)} does not match "
                                 f"this instance's: {'; '.join(problems)} (start both with the same model, "
                                 "--block-size and --kv-cache-dtype)")
        self._checked.add(address)

    def _ask(self, address: str, msg: dict) -> list[zmq.Frame]:
        sock = self._socket(address)
        sock.send(_encode(msg))
        if not sock.poll(self._timeout_ms):
            self._drop(address)
            raise _TransferError(f"KV transfer from {address} timed out: no answer to {msg['op']} within "
                                 f"{self._timeout_ms / 1000:.1f} s (is the prefill instance running?)")
        return sock.recv_multipart(copy=False)

    def _drop(self, address: str) -> None:
        self._sockets.pop(address).close(linger=0)
        self._checked.discard(address)


def _encode(msg: dict) -> bytes:
    return json.dumps(msg).encode()


def _decode(raw: bytes) -> dict:
    try:
        msg = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return {}
    return msg if isinstance(msg, dict) else {}
