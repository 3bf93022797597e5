"""Errors in OpenAI's shape: APIError for what a request got wrong, the handlers that turn it,
FastAPI's validation errors and HTTP errors into `{"error": {...}}` bodies, and their OpenAPI entries.
The Anthropic Messages routes (/v1/messages...) answer the same errors in Anthropic's shape,
`{"type": "error", "error": {"type": ..., "message": ...}}`, which its SDKs read.
"""
from __future__ import annotations

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from twostep.entrypoints.openai.responses import ErrorResponse


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                413: "RequestTooLargeError", 500: "InternalServerError", 503: "ServiceUnavailableError"}


def error_response(status: int, message: str, param: str | None = None,
                   retry_after: int | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": _ERROR_TYPES.get(status, "APIError"),
                      "param": param, "code": status}}
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return JSONResponse(body, status_code=status, headers=headers)


def speaks_anthropic(path: str) -> bool:
    """Whether a path is one of the Anthropic Messages routes, whose errors take Anthropic's shape."""
    return path == "/v1/messages" or path.startswith("/v1/messages/")


_ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                          404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                          529: "overloaded_error"}


def anthropic_error_body(status: int, message: str) -> tuple[int, dict]:
    """(status, body) of an error in Anthropic's shape. A full queue (503) is Anthropic's 529
    overloaded_error, which its clients retry."""
    status = 529 if status == 503 else status
    kind = _ANTHROPIC_ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return status, {"type": "error", "error": {"type": kind, "message": message}}


def error_response_for(path: str, status: int, message: str, param: str | None = None,
                       retry_after: int | None = None) -> JSONResponse:
    """An error in the shape the route at `path` speaks: Anthropic's or OpenAI's."""
    if not speaks_anthropic(path):
        return error_response(status, message, param, retry_after)
    status, body = anthropic_error_body(status, message)
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return JSONResponse(body, status_code=status, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc: RequestValidationError):
        path = request.url.path
        errors = exc.errors() or [{"loc": (), "msg": "invalid request"}]
        err = _deepest(errors) if speaks_anthropic(path) else errors[0]
        if err.get("type") == "json_invalid":
            return error_response_for(path, 400, "malformed JSON body: "
                                                 f"{err.get('ctx', {}).get('error', err.get('msg'))}")
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if speaks_anthropic(path):
            loc = [x for x in loc if not _is_union_label(x)]
        where = ".".join(loc)
        return error_response_for(path, 400, f"{where + ': ' if where else ''}{err.get('msg')}", where or None)

    @app.exception_handler(APIError)
    async def _api(request, exc: APIError):
        # a full queue (the only 503 an APIError carries) drains in seconds
        return error_response_for(request.url.path, exc.status, exc.message, exc.param,
                                  1 if exc.status == 503 else None)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, exc: StarletteHTTPException):
        response = error_response_for(request.url.path, exc.status_code, str(exc.detail))
        response.headers.update(exc.headers or {})      # 405's Allow
        return response


def _deepest(errors: list[dict]) -> dict:
    """The error that got furthest into the body: where a value may be a string or a list of
    blocks, the list's own error, not that the value is no string."""
    return max(errors, key=lambda e: len(e.get("loc", ())))


def _is_union_label(part: str) -> bool:
    """pydantic names a union's member in an error's location ("str", "list[...]"); a client
    knows only the fields."""
    return "[" in part or part in ("str", "int", "float", "bool", "dict", "list", "none")


def error_responses(*codes: int) -> dict:
    return {code: {"model": ErrorResponse, "description": _ERROR_TYPES[code]} for code in codes}
