"""The engine in a background thread, for asyncio callers (the HTTP server).

The LLMEngine is single-threaded: only the engine thread touches it. Callers post commands
(add, abort) to an inbox and receive outputs on a per-request asyncio.Queue, filled with
call_soon_threadsafe, so the event loop never waits for a model step. Adds answer through a
future, so a bad request's ValueError reaches its caller before any streaming starts.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from twostep.engine.llm_engine import LLMEngine
from twostep.outputs import PoolingRequestOutput, RequestOutput
from twostep.pooling_params import PoolingParams
from twostep.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """The waiting queue is at --max-queued-requests."""


@dataclass
class _Add:
    prompt: str | list[int]
    params: SamplingParams | PoolingParams
    request_id: str
    sink: asyncio.Queue
    priority: int = 0
    done: Future = field(default_factory=Future)


@dataclass
class _Abort:
    request_id: str | None      # None: every request in flight


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_queued_requests: int | None = None,
                 request_timeout: float | None = None,
                 on_step: Callable[[LLMEngine, list[RequestOutput | PoolingRequestOutput]], None] | None = None,
                 ) -> None:
        self.engine = engine
        self.max_queued_requests = max_queued_requests
        self.request_timeout = request_timeout
        self.on_step = on_step                      # runs in the engine thread (metrics)
        self.on_failure: Callable[[BaseException], None] | None = None   # the loop died (the server exits)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, asyncio.Queue] = {}
        self._deadlines: dict[str, float] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._ids = 0
        self.error: BaseException | None = None

    # ---- event-loop side ----------------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="twostep-engine", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        """Abort whatever is still in flight and stop the thread."""
        self._stopping.set()
        self._inbox.put(None)
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join)

    @property
    def healthy(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    def new_request_id(self, prefix: str) -> str:
        self._ids += 1
        return f"{prefix}-{self._ids}"

    async def add(self, prompt: str | list[int], params: SamplingParams | PoolingParams, request_id: str,
                  sink: asyncio.Queue | None = None, priority: int = 0) -> asyncio.Queue:
        """Queue a request; raises ValueError (bad input) or QueueFullError before any output.
        Outputs go to `sink` (several requests may share one: outputs carry their request_id)."""
        if not self.healthy:
            raise RuntimeError("the engine is not running")
        sink = asyncio.Queue() if sink is None else sink
        cmd = _Add(prompt, params, request_id, sink, priority)
        self._inbox.put(cmd)
        await asyncio.wrap_future(cmd.done)
        return sink

    def abort(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))

    def abort_all(self) -> None:
        """End every in-flight request (finish_reason "abort"); their streams close normally."""
        self._inbox.put(_Abort(None))

    async def generate(self, prompt: str | list[int], params: SamplingParams,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        """Outputs of one request until it finishes; leaving early (disconnect) aborts it."""
        sink = await self.add(prompt, params, request_id)
        finished = False
        try:
            while True:
                out = await sink.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    # ---- engine thread -------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                self._drain_inbox(block=not self.engine.has_unfinished_requests())
                self._expire_deadlines()
                # held KV blocks (a producer's) are freed by a step, even with nothing to run
                if self.engine.has_unfinished_requests() or self.engine.has_pending_transfers():
                    outputs = self.engine.step()
                    self._deliver(outputs)
                    if self.on_step is not None:
                        self.on_step(self.engine, outputs)
        except BaseException as e:  # a bug, not bad input: fail every waiting caller loudly
            logger.exception("engine loop failed")
            self.error = e
            self._fail_all(e)
            if self.on_failure is not None:
                self.on_failure(e)
            return
        self._abort_all()

    def _drain_inbox(self, block: bool) -> None:
        try:
            cmd = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while cmd is not None:
            self._handle(cmd)
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, cmd) -> None:
        if isinstance(cmd, _Abort):
            if cmd.request_id is None:
                logger.info("aborting %d in-flight requests", len(self._sinks))
            self.engine.abort_request(list(self._sinks) if cmd.request_id is None else cmd.request_id)
            return
        try:
            # n > 1 fans out into n sequences, each of which waits (a pooling request is one)
            waiting, adds = self.engine.num_waiting, cmd.params.n if isinstance(cmd.params, SamplingParams) else 1
            if self.max_queued_requests is not None and waiting + adds > self.max_queued_requests:
                raise QueueFullError(f"the server has {waiting} requests waiting, this one adds "
                                     f"{adds} (--max-queued-requests {self.max_queued_requests}); "
                                     "retry later")
            self.engine.add_request(cmd.prompt, cmd.params, request_id=cmd.request_id, priority=cmd.priority)
        except Exception as e:  # ValueError for bad input, QueueFullError: the caller's problem
            cmd.done.set_exception(e)
            return
        self._sinks[cmd.request_id] = cmd.sink
        if self.request_timeout is not None:
            self._deadlines[cmd.request_id] = time.monotonic() + self.request_timeout
        cmd.done.set_result(cmd.request_id)

    def _expire_deadlines(self) -> None:
        now = time.monotonic()
        for rid in [r for r, t in self._deadlines.items() if t <= now]:
            del self._deadlines[rid]
            logger.info("request %s ran past --request-timeout %.1fs", rid, self.request_timeout)
            self.engine.abort_request(rid, finish_reason="length", stop_reason="timeout")

    def _deliver(self, outputs: list[RequestOutput | PoolingRequestOutput]) -> None:
        batch = []
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is not None:
                batch.append((sink, out))
            if out.finished:
                self._sinks.pop(out.request_id, None)
                self._deadlines.pop(out.request_id, None)
        if batch:
            self._loop.call_soon_threadsafe(_put_all, batch)

    def _abort_all(self) -> None:
        rids = list(self._sinks)
        self.engine.abort_request(rids)
        while self.engine.has_unfinished_requests():
            self._deliver(self.engine.step())

    def _fail_all(self, error: BaseException) -> None:
        batch = [(sink, error) for sink in self._sinks.values()]
        self._sinks.clear()
        if batch:
            self._loop.call_soon_threadsafe(_put_all, batch)
        while True:  # callers still waiting on an add
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, _Add):
                cmd.done.set_exception(RuntimeError("the engine stopped"))


def _put_all(batch) -> None:
    for sink, item in batch:
        sink.put_nowait(item)
