"""One HTTP request's engine requests (a prompt each; n samples fan out inside the engine): their
outputs share one asyncio queue, a client that goes away aborts them at once, and a full queue is
a 503.
"""
from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

from fastapi import Request

from twostep.entrypoints.async_engine import QueueFullError
from twostep.entrypoints.openai.errors import APIError
from twostep.entrypoints.openai.serving import Choice
from twostep.entrypoints.openai.state import ServerState
from twostep.outputs import PoolingRequestOutput, RequestOutput
from twostep.pooling_params import PoolingParams
from twostep.sampling_params import SamplingParams


class Batch:
    """The engine requests of one HTTP request, sharing one output queue."""

    def __init__(self, state: ServerState, prefix: str, request_id: str | None = None) -> None:
        self.state = state
        self.id = f"{prefix}-{request_id or uuid.uuid4().hex}"   # vLLM's request_id names the response
        self.sink: asyncio.Queue = asyncio.Queue()
        self.request_ids: list[str] = []
        self.finished: set[str] = set()
        self.prompt_logprobs: list = []    # per prompt, filled by collect (echo)
        self.kv_transfer_params: dict | None = None   # a prefill instance's answer for the decode one

    async def add(self, prompts: list[str | list[int]], params: SamplingParams | PoolingParams,
                  priority: int = 0) -> None:
        try:
            for i, prompt in enumerate(prompts):
                rid = f"{self.id}-{i}"
                await self.state.engine.add(prompt, params, rid, self.sink, priority)
                self.request_ids.append(rid)
        except QueueFullError as e:
            self.abort()
            raise APIError(503, str(e)) from None
        except ValueError as e:
            self.abort()
            raise APIError(400, str(e)) from None

    def abort(self) -> None:
        for rid in self.request_ids:
            if rid not in self.finished:
                self.state.engine.abort(rid)

    async def outputs(self, raw: Request | None = None,
                      ) -> AsyncIterator[tuple[int, RequestOutput | PoolingRequestOutput]]:
        """(prompt index, output) until every request finished. With `raw` (non-streaming
        responses) a watcher polls the connection meanwhile: a client that left ends it at once,
        however fast tokens arrive."""
        left = asyncio.create_task(_client_leaves(raw)) if raw is not None else None
        try:
            while len(self.finished) < len(self.request_ids):
                out = await self._next(left)
                if out is None:
                    return
                if isinstance(out, BaseException):
                    raise APIError(500, f"engine failure: {out}")
                if isinstance(out, PoolingRequestOutput):      # one output, its vector: nothing else to read
                    self.finished.add(out.request_id)
                    yield self.request_ids.index(out.request_id), out
                    continue
                failed = [c.stop_reason for c in out.outputs if c.finish_reason == "error"]
                if failed:          # e.g. a remote prefill's KV could not be loaded
                    self.finished.add(out.request_id)
                    raise APIError(500, str(failed[0]))
                if out.finished:
                    self.finished.add(out.request_id)
                    if out.kv_transfer_params is not None:
                        self.kv_transfer_params = out.kv_transfer_params
                yield self.request_ids.index(out.request_id), out
        finally:
            if left is not None:
                left.cancel()
            self.abort()  # no-op for finished requests; frees blocks of a client that left

    async def _next(self, left: asyncio.Task | None):
        """The next output, or None once the client has left."""
        if left is None:
            return await self.sink.get()
        if not self.sink.empty():
            return self.sink.get_nowait()
        get = asyncio.ensure_future(self.sink.get())
        try:
            done, _ = await asyncio.wait({get, left}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not get.done():
                get.cancel()        # the item, if one came, stays in the queue
        return get.result() if get in done else None


async def _client_leaves(raw: Request, every: float = 0.1) -> None:
    """Returns when the client has disconnected."""
    while not await raw.is_disconnected():
        await asyncio.sleep(every)


async def collect(batch: Batch, n: int, raw: Request):
    choices: list[Choice | None] = [None] * (len(batch.request_ids) * n)
    cached = [0] * len(batch.request_ids)
    prompt_ids: list[list[int]] = [[] for _ in batch.request_ids]
    batch.prompt_logprobs = [None] * len(batch.request_ids)
    async for i, out in batch.outputs(raw):
        if not out.finished:
            continue
        cached[i], prompt_ids[i] = out.num_cached_tokens, out.prompt_token_ids
        batch.prompt_logprobs[i] = out.prompt_logprobs
        for c in out.outputs:
            choices[i * n + c.index] = Choice(
                index=i * n + c.index, prompt_token_ids=out.prompt_token_ids, text=c.text,
                token_ids=c.token_ids, logprobs=c.logprobs, finish_reason=c.finish_reason,
                stop_reason=c.stop_reason)
    if any(c is None for c in choices):
        raise APIError(499, "client disconnected")
    return choices, cached, prompt_ids


def with_transfer(response: dict, batch: Batch) -> dict:
    """A prefill instance's answer names where its KV blocks wait (vLLM's kv_transfer_params)."""
    if batch.kv_transfer_params is not None:
        response["kv_transfer_params"] = batch.kv_transfer_params
    return response
