"""An HTTP request handed from the front to a replica's app in that replica's process, as messages Ray
can carry: the request whole (ForwardedRequest), then the response as it comes (a ResponseStart,
then body chunks). The app is called as an ASGI server would call it; when the caller stops reading
(the front's client went away, or Ray cancelled the call) the app sees the client disconnect, so a
twostep route aborts its engine requests exactly as it does behind uvicorn.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ForwardedRequest:
    method: str
    path: str
    query: str = ""
    headers: tuple[tuple[str, str], ...] = ()
    body: bytes = b""


@dataclass(frozen=True, slots=True)
class ResponseStart:
    status: int
    headers: tuple[tuple[str, str], ...]
    replica: str                  # the replica that answers

    def header(self, name: str) -> str | None:
        return next((v for k, v in self.headers if k == name), None)


async def call_app(app, request: ForwardedRequest, replica: str) -> AsyncIterator[ResponseStart | bytes]:
    """The app's response to request: a ResponseStart, then its body's chunks."""
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": request.method, "scheme": "http", "path": request.path,
             "raw_path": request.path.encode(), "query_string": request.query.encode(), "root_path": "",
             "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in request.headers],
             "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0)}
    messages: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    body_given = False

    async def receive() -> dict:
        nonlocal body_given
        if not body_given:
            body_given = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await messages.put(message)

    task = asyncio.ensure_future(app(scope, receive, send))
    task.add_done_callback(lambda _: messages.put_nowait(None))
    answered = False
    try:
        while (message := await messages.get()) is not None:
            if message["type"] == "http.response.start":
                headers = tuple((k.decode("latin-1"), v.decode("latin-1")) for k, v in message.get("headers", ()))
                yield ResponseStart(message["status"], headers, replica)
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield message["body"]
                if not message.get("more_body"):
                    answered = True
                    break
        else:
            task.result()              # the app failed before it answered: raise its error
    finally:
        gone.set()                     # the app sees its client go (or, answered, finishes on its own)
        if answered:
            await task
        elif not task.done():
            task.cancel()
