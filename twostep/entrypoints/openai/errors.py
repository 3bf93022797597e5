"""Errors in OpenAI's shape: APIError for what a request got wrong, the handlers that turn it,
FastAPI's validation errors and HTTP errors into `{"error": {...}}` bodies, and their OpenAPI entries.
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


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _invalid(_request, exc: RequestValidationError):
        err = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        if err.get("type") == "json_invalid":
            return error_response(400, f"malformed JSON body: {err.get('ctx', {}).get('error', err.get('msg'))}")
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        where = ".".join(loc)
        return error_response(400, f"{where + ': ' if where else ''}{err.get('msg')}", where or None)

    @app.exception_handler(APIError)
    async def _api(_request, exc: APIError):
        # a full queue (the only 503 an APIError carries) drains in seconds
        return error_response(exc.status, exc.message, exc.param, 1 if exc.status == 503 else None)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_request, exc: StarletteHTTPException):
        response = error_response(exc.status_code, str(exc.detail))
        response.headers.update(exc.headers or {})      # 405's Allow
        return response


def error_responses(*codes: int) -> dict:
    return {code: {"model": ErrorResponse, "description": _ERROR_TYPES[code]} for code in codes}
