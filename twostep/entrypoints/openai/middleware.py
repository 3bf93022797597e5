"""ASGI middleware in front of every route: the request body's size limit (413) and the API key
(401), both answered before a route reads the body, in the shape the route speaks (errors.py).
"""
from __future__ import annotations

import hmac
import ipaddress

from starlette.exceptions import HTTPException as StarletteHTTPException

from twostep.entrypoints.openai.errors import error_response_for


class BodySizeLimit:
    """413 for a request body over max_bytes, from its Content-Length before reading it, or as
    soon as a body without one (chunked) grows past the limit."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await self._refuse(scope, receive, send)
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:   # FastAPI passes HTTPExceptions through its body parsing
                raise StarletteHTTPException(413, self._message())
            return message

        await self.app(scope, counted, send)

    def _message(self) -> str:
        return f"the request body is over {self.max_bytes:,} bytes (the server's --max-request-body-bytes)"

    async def _refuse(self, scope, receive, send):
        await error_response_for(scope["path"], 413, self._message())(scope, receive, send)


class RequireAPIKey:
    """The API key on every route but open_paths, as `Authorization: Bearer <key>` (OpenAI's SDKs)
    or `x-api-key: <key>` (Anthropic's). Pure ASGI (not BaseHTTPMiddleware, under which a handler
    can no longer see its client disconnect)."""

    def __init__(self, app, api_key: str, open_paths: set[str]) -> None:
        self.app, self.open_paths = app, open_paths
        self.bearer, self.key = f"Bearer {api_key}".encode(), api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        bearer_ok = hmac.compare_digest(headers.get(b"authorization", b""), self.bearer)
        key_ok = hmac.compare_digest(headers.get(b"x-api-key", b""), self.key)
        if bearer_ok or key_ok:
            return await self.app(scope, receive, send)
        response = error_response_for(scope["path"], 401, "missing or wrong API key: send the header "
                                      "'Authorization: Bearer <key>' or 'x-api-key: <key>' with the server's --api-key")
        response.headers["WWW-Authenticate"] = "Bearer"
        await response(scope, receive, send)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
