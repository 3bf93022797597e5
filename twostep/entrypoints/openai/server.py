"""`twostep serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over the AsyncEngine.

Every HTTP request becomes one engine request per prompt (n samples fan out inside the
engine); their outputs share one asyncio queue. Streaming responses are server-sent events
ending with `data: [DONE]`; a client that goes away aborts its requests at once.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import ipaddress
import json
import logging
import signal
import uuid
from dataclasses import dataclass
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from twostep.engine.llm_engine import LLMEngine
from twostep.entrypoints.async_engine import AsyncEngine, QueueFullError
from twostep.entrypoints.openai import serving
from twostep.entrypoints.openai.metrics import ServerMetrics
from twostep.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest,
                                                 DetokenizeRequest, TokenizeRequest, messages_as_dicts)
from twostep import __version__ as TWOSTEP_VERSION
from twostep.entrypoints.openai.responses import (ChatCompletionResponse, CompletionResponse,
                                                  DetokenizeResponse, ErrorResponse, ModelCard, ModelList,
                                                  TokenizeResponse, TokenizerInfoResponse, VersionResponse)
from twostep.entrypoints.openai.serving import Choice
from twostep.entrypoints.openai.tool_choice import ToolChoiceError, ToolPlan, plan_tools
from twostep.entrypoints.openai.tool_parsers import (TOOL_PARSERS, StreamDelta, ToolCallStreamer,
                                                     extract_tool_calls, get_tool_parser)
from twostep.outputs import RequestOutput
from twostep.sampling_params import SamplingParams, StructuredOutputsParams

logger = logging.getLogger(__name__)


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                413: "RequestTooLargeError", 500: "InternalServerError", 503: "ServiceUnavailableError"}
DEFAULT_MAX_BODY_BYTES = 4 << 20
# chat_template_kwargs a request may set: plain values the template reads; never the template itself
# (or tools) unless the server trusts requests' templates
_TEMPLATE_SOURCES = ("chat_template", "tools", "documents")


def error_response(status: int, message: str, param: str | None = None,
                   retry_after: int | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": _ERROR_TYPES.get(status, "APIError"),
                      "param": param, "code": status}}
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return JSONResponse(body, status_code=status, headers=headers)


@dataclass(slots=True)
class ServerConfig:
    """`twostep serve`'s own settings (the engine's are EngineConfig)."""

    model_name: str
    chat_template: str | None = None             # --chat-template: instead of the model's
    max_queued_requests: int | None = None        # None: QUEUED_PER_RUNNING x the engine's max_num_seqs
    request_timeout: float | None = None
    api_key: str | None = None
    metrics_need_key: bool = False               # /metrics behind the API key too
    max_request_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    trust_request_chat_template: bool = False    # chat_template_kwargs may carry a template
    model_aliases: tuple[str, ...] = ()          # other names requests may use (--model as given)
    enable_tokenizer_info_endpoint: bool = False  # GET /tokenizer_info (it shows the chat template)
    enable_auto_tool_choice: bool = False        # tool_choice "auto": parse calls out of the output
    tool_call_parser: str | None = None          # --tool-call-parser: hermes, llama3_json, mistral, pythonic

    def __post_init__(self) -> None:
        if self.max_queued_requests is not None and self.max_queued_requests < 1:
            raise ValueError(f"--max-queued-requests must be at least 1; got {self.max_queued_requests}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser "
                             f"({', '.join(sorted(TOOL_PARSERS))})")
        if self.tool_call_parser is not None:
            get_tool_parser(self.tool_call_parser)    # an unknown name fails at start-up

    @property
    def auto_tool_parser(self) -> str | None:
        return self.tool_call_parser if self.enable_auto_tool_choice else None


@dataclass
class ServerState:
    engine: AsyncEngine
    model_name: str
    metrics: ServerMetrics
    config: ServerConfig

    @property
    def tokenizer(self):
        return self.engine.engine.tokenizer


# A default server queues this many sequences per one it runs (--max-num-seqs) and answers 503 with
# Retry-After past that, as a server behind a load balancer should: never an unbounded queue that one
# request (prompts x n) can fill.
QUEUED_PER_RUNNING = 4


def build_app(llm_engine: LLMEngine, config: ServerConfig) -> FastAPI:
    if config.max_queued_requests is None:
        config = dataclasses.replace(config, max_queued_requests=QUEUED_PER_RUNNING * llm_engine.config.max_num_seqs)
    model_name = config.model_name
    metrics = ServerMetrics(model_name)

    def on_step(engine: LLMEngine, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            if out.finished:
                metrics.observe_finished(out)
        metrics.refresh(engine)

    state = ServerState(AsyncEngine(llm_engine, config.max_queued_requests, config.request_timeout,
                                    on_step), model_name, metrics, config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        state.engine.start()
        yield
        await state.engine.shutdown()
        llm_engine.shutdown()

    app = FastAPI(title="twostep", lifespan=lifespan)
    app.state.twostep = state
    _install_error_handlers(app)
    if config.api_key:
        app.add_middleware(RequireAPIKey, api_key=config.api_key,
                           open_paths={"/health"} | (set() if config.metrics_need_key else {"/metrics"}))
    app.add_middleware(BodySizeLimit, max_bytes=config.max_request_body_bytes)
    _add_routes(app, state)
    app.openapi = lambda: _openapi(app, bool(config.api_key), config.metrics_need_key)
    return app


def _openapi(app: FastAPI, with_key: bool, metrics_need_key: bool) -> dict:
    """FastAPI's schema, made true to the server: invalid input is a 400 in OpenAI's shape (FastAPI
    declares a 422 the server never sends), and with an API key every route but /health may 401."""
    if app.openapi_schema is None:
        schema = get_openapi(title="twostep", version="0.1.0", routes=app.routes)
        error = {"description": "invalid request",
                 "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
        for path, methods in schema["paths"].items():
            for op in methods.values():
                responses = op["responses"]
                if responses.pop("422", None) is not None:
                    responses.setdefault("400", error)
                if with_key and path != "/health" and (path != "/metrics" or metrics_need_key):
                    responses.setdefault("401", {**error, "description": "missing or wrong API key"})
        for unused in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(unused, None)
        app.openapi_schema = schema
    return app.openapi_schema


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
        await error_response(413, self._message())(scope, receive, send)


class RequireAPIKey:
    """Bearer authentication on every route but open_paths. Pure ASGI (not BaseHTTPMiddleware,
    under which a handler can no longer see its client disconnect)."""

    def __init__(self, app, api_key: str, open_paths: set[str]) -> None:
        self.app, self.open_paths = app, open_paths
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers") or []).get(b"authorization", b"")
        if hmac.compare_digest(given, self.expected):
            return await self.app(scope, receive, send)
        response = error_response(401, "missing or wrong API key: send the header "
                                       "'Authorization: Bearer <key>' with the server's --api-key")
        response.headers["WWW-Authenticate"] = "Bearer"
        await response(scope, receive, send)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _install_error_handlers(app: FastAPI) -> None:
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


def _errors(*codes: int) -> dict:
    return {code: {"model": ErrorResponse, "description": _ERROR_TYPES[code]} for code in codes}


def _json_or_events(model) -> dict:
    """200: the model as JSON, or server-sent events with stream: true."""
    return {200: {"model": model, "description": "the completion (JSON), or with stream: true its "
                  "chunks as server-sent events ending with data: [DONE]",
                  "content": {"text/event-stream": {"schema": {"type": "string"}}}}}


def _add_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/health", response_class=PlainTextResponse,
             responses={200: {"description": "the engine loop runs"}, 503: {
                 "description": "the engine loop stopped",
                 "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}})
    async def health():
        if not state.engine.healthy:
            return error_response(503, "the engine loop is not running")
        return PlainTextResponse("")

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"description": "Prometheus text format",
                              "content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}}}})
    async def metrics():
        # counters that move between steps (a KV transfer producer serves reads on its own thread,
        # and an idle engine does not step) are read now, not at the last step
        state.metrics.refresh(state.engine.engine)
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", response_model=None, responses={200: {"model": ModelList}})
    async def models():
        return {"object": "list", "data": [_model_card(state)]}

    @app.post("/tokenize", response_model=None, responses={200: {"model": TokenizeResponse}, **_errors(400, 404, 413)})
    async def tokenize(body: TokenizeRequest):
        _check_model(state, body.model)
        if body.messages is not None:
            ids = await _encode_chat(state, body.messages, body.add_generation_prompt)
        elif body.prompt is not None:
            ids = await asyncio.to_thread(state.tokenizer.encode, body.prompt, body.add_special_tokens)
        else:
            raise APIError(400, "give either prompt or messages", "prompt")
        return {"tokens": ids, "count": len(ids), "max_model_len": state.engine.engine.max_model_len}

    @app.post("/detokenize", response_model=None, responses={200: {"model": DetokenizeResponse}, **_errors(400, 404, 413)})
    async def detokenize(body: DetokenizeRequest):
        _check_model(state, body.model)
        vocab = state.engine.engine.model_config.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token ids out of range [0, {vocab}): {bad[:5]}", "tokens")
        return {"prompt": await asyncio.to_thread(state.tokenizer.decode, body.tokens, False)}

    @app.post("/v1/completions", response_model=None,
              responses={**_json_or_events(CompletionResponse), **_errors(400, 404, 413, 503)})
    async def completions(body: CompletionRequest, raw: Request, response: Response):
        return _note_ignored(body, response, await _completions(state, body, raw))

    @app.post("/v1/chat/completions", response_model=None,
              responses={**_json_or_events(ChatCompletionResponse), **_errors(400, 404, 413, 503)})
    async def chat(body: ChatCompletionRequest, raw: Request, response: Response):
        return _note_ignored(body, response, await _chat(state, body, raw))

    @app.get("/v1/models/{model_id:path}", response_model=None, responses={200: {"model": ModelCard},
                                                                       **_errors(404)})
    async def model(model_id: str):
        _check_model(state, model_id)
        return _model_card(state)

    @app.get("/version", response_model=None, responses={200: {"model": VersionResponse}})
    async def version():
        return {"version": TWOSTEP_VERSION}

    if state.config.enable_tokenizer_info_endpoint:
        @app.get("/tokenizer_info", response_model=None, responses={200: {"model": TokenizerInfoResponse}})
        async def tokenizer_info():
            return _tokenizer_info(state)


def _tokenizer_info(state: ServerState) -> dict:
    """What a client needs to tokenize as the server does (lm-eval's tokenizer_backend=remote): the
    special tokens, the chat template, the limits."""
    tok = state.tokenizer
    template = tok.chat_template
    if isinstance(template, dict):
        template = template.get("default")
    return {"tokenizer_class": "PreTrainedTokenizerFast", **tok.special_tokens_map,
            "add_bos_token": tok.add_bos_token, "chat_template": template,
            "model_max_length": state.engine.engine.max_model_len, "vocab_size": tok.vocab_size}


def _model_card(state: ServerState) -> dict:
    return {"id": state.model_name, "object": "model", "created": serving.now(), "owned_by": "twostep",
            "root": state.model_name, "max_model_len": state.engine.engine.max_model_len}


_MAX_NAMED_FIELDS = 20    # an x-ignored-fields header names at most this many (64 characters each)


def _note_ignored(body, response: Response, result):
    """Fields the request sent that this server does not know: logged, and named in a header
    (ASCII: other characters as JSON escapes)."""
    fields = body.ignored_fields()
    if fields:
        names = [json.dumps(f[:64])[1:-1] for f in fields[:_MAX_NAMED_FIELDS]]
        if len(fields) > _MAX_NAMED_FIELDS:
            names.append(f"... ({len(fields) - _MAX_NAMED_FIELDS} more)")
        logger.warning("ignored request fields: %s", ", ".join(names))
        headers = result.headers if isinstance(result, Response) else response.headers
        headers["x-ignored-fields"] = ", ".join(names)
    return result


def _check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.model_name and model not in state.config.model_aliases:
        raise APIError(404, f"the model {model!r} does not exist; this server serves "
                            f"{state.model_name!r}", "model")


# ---- running a batch of engine requests for one HTTP request ---------------------------------

class _Batch:
    """The engine requests of one HTTP request, sharing one output queue."""

    def __init__(self, state: ServerState, prefix: str, request_id: str | None = None) -> None:
        self.state = state
        self.id = f"{prefix}-{request_id or uuid.uuid4().hex}"   # vLLM's request_id names the response
        self.sink: asyncio.Queue = asyncio.Queue()
        self.request_ids: list[str] = []
        self.finished: set[str] = set()
        self.prompt_logprobs: list = []    # per prompt, filled by _collect (echo)
        self.kv_transfer_params: dict | None = None   # a prefill instance's answer for the decode one

    async def add(self, prompts: list[str | list[int]], params: SamplingParams, priority: int = 0) -> None:
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

    async def outputs(self, raw: Request | None = None) -> AsyncIterator[tuple[int, RequestOutput]]:
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


# ---- /v1/completions -------------------------------------------------------------------------

async def _completions(state: ServerState, body: CompletionRequest, raw: Request):
    _check_model(state, body.model)
    if body.best_of not in (None, body.n):
        raise APIError(400, "best_of is not supported (only best_of == n)", "best_of")
    prompts = body.prompts()
    if not prompts:
        raise APIError(400, "prompt is empty", "prompt")
    if body.kv_transfer_params is not None and len(prompts) > 1:
        raise APIError(400, "kv_transfer_params take one prompt per request", "kv_transfer_params")
    if body.max_tokens is not None and body.max_tokens < 0:
        raise APIError(400, f"max_tokens must be >= 0, got {body.max_tokens}", "max_tokens")
    if body.max_tokens == 0 and not body.echo:
        # vLLM's answer (max_tokens 0 is only for echo: prompt logprobs without generating)
        raise APIError(400, "max_tokens must be at least 1, got 0 (0 only with echo: true)", "max_tokens")
    max_tokens = 1 if body.max_tokens == 0 else body.max_tokens   # echo-only: drop the token later
    _check_prompt_logprobs(state, body)
    prompt_lps = body.logprobs if body.echo and body.logprobs is not None else None
    if body.prompt_logprobs is not None:
        prompt_lps = max(body.prompt_logprobs, prompt_lps or 0)
    _check_logprobs(state, "logprobs", body.logprobs)
    params = _params(state, body, max_tokens, body.logprobs, prompt_lps)
    await _compile_constraint(state, params)
    _check_fan_out(state, len(prompts), body.n)
    prompt_ids = [body.truncate(ids) for ids in await _prompt_ids(state, prompts, body.add_special_tokens)]
    note = "" if "max_tokens" in body.model_fields_set else " (the default)"
    for ids in prompt_ids:
        _check_length(state, ids, max_tokens, "prompt", note)
    batch = _Batch(state, "cmpl", body.request_id)
    await batch.add(prompt_ids, params, body.priority)
    if body.stream:
        return _sse(_completion_stream(state, body, batch))
    choices, cached, prompt_ids = await _collect(batch, body.n, raw)
    if body.max_tokens == 0:
        for c in choices:
            c.text, c.token_ids, c.logprobs, c.finish_reason = "", [], [] if c.logprobs else None, "length"
    tok = state.tokenizer
    data = []
    for c in choices:
        text, lp = c.text, None
        if body.echo:
            prompt = prompts[c.index // body.n]
            prompt_text = prompt if isinstance(prompt, str) else tok.decode(prompt)
            text = prompt_text + text
        if body.logprobs is not None:
            ids, entries = c.token_ids, list(c.logprobs or [])
            if body.echo:
                prompt_lps = batch.prompt_logprobs[c.index // body.n] or [None] * len(c.prompt_token_ids)
                ids = c.prompt_token_ids + ids
                entries = list(prompt_lps) + entries
            lp = serving.completion_logprobs(tok, ids, entries, serving.TokenTexts(tok),
                                             body.return_tokens_as_token_ids)
        choice = {"index": c.index, "text": text, "logprobs": lp, "finish_reason": c.finish_reason,
                  "stop_reason": c.stop_reason}
        if body.prompt_logprobs is not None:
            choice["prompt_logprobs"] = serving.prompt_logprobs(
                tok, c.prompt_token_ids, batch.prompt_logprobs[c.index // body.n], body.prompt_logprobs)
        data.append(choice)
    return _with_transfer({"id": batch.id, "object": "text_completion", "created": serving.now(),
                           "model": state.model_name, "choices": data,
                           "usage": serving.usage(choices, prompt_ids, cached)}, batch)


async def _collect(batch: _Batch, n: int, raw: Request):
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


async def _completion_stream(state: ServerState, body: CompletionRequest, batch: _Batch):
    tok, n = state.tokenizer, body.n
    head = {"id": batch.id, "object": "text_completion", "created": serving.now(),
            "model": state.model_name}
    started: set[int] = set()
    done: set[int] = set()
    sent_tokens: dict[int, int] = {}
    token_texts: dict[int, serving.TokenTexts] = {}
    choices: dict[int, Choice] = {}
    prompts = body.prompts()
    cached = [0] * len(prompts)
    prompt_ids: list[list[int]] = [[] for _ in prompts]
    async for i, out in batch.outputs():
        cached[i], prompt_ids[i] = out.num_cached_tokens, out.prompt_token_ids
        for c in out.outputs:
            index = i * n + c.index
            if index in done:
                continue
            text, lp = c.delta_text, None
            entries_ids: list[int] = []
            entries: list = []
            if body.max_tokens == 0:
                text, c = "", _as_echo_only(c)
            if body.echo and index not in started:
                prompt = prompts[i]
                text = (prompt if isinstance(prompt, str) else tok.decode(prompt)) + text
                if body.logprobs is not None:
                    entries_ids, entries = list(out.prompt_token_ids), list(out.prompt_logprobs or
                                                                           [None] * len(out.prompt_token_ids))
            started.add(index)
            new = c.token_ids[sent_tokens.get(index, 0):]
            sent_tokens[index] = len(c.token_ids)
            if body.logprobs is not None:
                entries_ids += new
                entries += (c.logprobs or [])[len(c.logprobs or []) - len(new):] if new else []
                texts = token_texts.setdefault(index, serving.TokenTexts(tok))
                lp = serving.completion_logprobs(tok, entries_ids, entries, texts, body.return_tokens_as_token_ids)
            if not text and not new and not c.finish_reason:
                continue
            choices[index] = Choice(index=index, prompt_token_ids=out.prompt_token_ids,
                                    token_ids=c.token_ids)
            if c.finish_reason:
                done.add(index)
            yield {**head, "choices": [{"index": index, "text": text, "logprobs": lp,
                                        "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}]}
    if body.stream_options and body.stream_options.include_usage:
        yield {**head, "choices": [], "usage": serving.usage(list(choices.values()), prompt_ids, cached)}


def _as_echo_only(c):
    return dataclasses.replace(c, token_ids=[], logprobs=[] if c.logprobs is not None else None,
                               delta_text="", delta_token_ids=[],
                               finish_reason="length" if c.finish_reason else None)


# ---- /v1/chat/completions --------------------------------------------------------------------

async def _chat(state: ServerState, body: ChatCompletionRequest, raw: Request):
    _check_model(state, body.model)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if max_tokens is not None and max_tokens < 1:
        raise APIError(400, f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
    top = body.top_logprobs or 0
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    _check_logprobs(state, "top_logprobs", top)
    _check_fan_out(state, 1, body.n)
    _check_characters(state, sum(len(m.content) if isinstance(m.content, str) else
                                 sum(len(str(p.get("text", ""))) for p in m.content or [])
                                 for m in body.messages), "messages")
    try:
        plan = plan_tools(body, state.config.auto_tool_parser)
    except ToolChoiceError as e:
        raise APIError(400, str(e), e.param) from None
    _check_prompt_logprobs(state, body)
    ids = body.truncate(await _encode_chat(state, body.messages, body.add_generation_prompt,
                                           body.chat_template_kwargs, plan.template_tools, body))
    _check_length(state, ids, max_tokens, "messages")
    params = _params(state, body, max_tokens, top if body.logprobs else None, body.prompt_logprobs,
                     plan.constraint)
    if plan.parser is not None and plan.parser.needs_special_tokens:
        params.skip_special_tokens = False       # the call markup is a special token
    await _compile_constraint(state, params)
    batch = _Batch(state, "chatcmpl", body.request_id)
    await batch.add([ids], params, body.priority)
    if body.stream:
        return _sse(_chat_stream(state, body, batch, top, plan))
    choices, cached, prompt_ids = await _collect(batch, body.n, raw)
    tok = state.tokenizer
    echo = _echoed(body)
    for c in choices:
        c.text = echo + c.text
    data = [{"index": c.index, **_chat_message(c, plan),
             "logprobs": serving.chat_logprobs(tok, c.token_ids, c.logprobs, top, serving.TokenTexts(tok),
                                               body.return_tokens_as_token_ids)
             if body.logprobs else None, "stop_reason": c.stop_reason} for c in choices]
    response = {"id": batch.id, "object": "chat.completion", "created": serving.now(),
                "model": state.model_name, "choices": data, "usage": serving.usage(choices, prompt_ids, cached)}
    if body.prompt_logprobs is not None:
        response["prompt_logprobs"] = serving.prompt_logprobs(tok, prompt_ids[0], batch.prompt_logprobs[0],
                                                              body.prompt_logprobs)
    return _with_transfer(response, batch)


def _with_transfer(response: dict, batch: _Batch) -> dict:
    """A prefill instance's answer names where its KV blocks wait (vLLM's kv_transfer_params)."""
    if batch.kv_transfer_params is not None:
        response["kv_transfer_params"] = batch.kv_transfer_params
    return response


def _echoed(body: ChatCompletionRequest) -> str:
    """vLLM's chat echo: the reply starts with the last message when it is the assistant's."""
    last = body.messages[-1]
    if not body.echo or last.role != "assistant":
        return ""
    content = last.content
    return content if isinstance(content, str) else "".join(str(p.get("text", "")) for p in content or [])


def _check_prompt_logprobs(state: ServerState, body) -> None:
    if body.prompt_logprobs is not None and body.stream:
        raise APIError(400, "prompt_logprobs is not supported with stream: true", "prompt_logprobs")
    _check_logprobs(state, "prompt_logprobs", body.prompt_logprobs)


def _chat_message(c: Choice, plan: ToolPlan) -> dict:
    """The assistant message and finish_reason of one choice, with the calls read out of its text."""
    message = {"role": "assistant", "content": c.text}
    if plan.parser is None:
        return {"message": message, "finish_reason": c.finish_reason}
    content, calls = extract_tool_calls(plan.parser, c.text)
    calls = calls[:plan.max_calls] if plan.max_calls is not None else calls
    if not calls:
        return {"message": message, "finish_reason": c.finish_reason}
    message = {"role": "assistant", "content": content,
               "tool_calls": [{"id": t.id, "type": "function",
                               "function": {"name": t.name, "arguments": t.arguments}} for t in calls]}
    return {"message": message, "finish_reason": _tool_finish(c.finish_reason, plan)}


def _tool_finish(finish_reason: str | None, plan: ToolPlan) -> str | None:
    """A stop with calls is "tool_calls", except for a forced function (OpenAI and vLLM say "stop")."""
    return "tool_calls" if finish_reason == "stop" and plan.calls_finish else finish_reason


async def _compile_constraint(state: ServerState, params: SamplingParams) -> None:
    """Compile the request's grammar in a worker thread (cached: the engine's own compile of it is
    then a lookup), so a long compile never holds up the engine's steps; a bad one is a 400."""
    so = params.structured_outputs
    if so is None:
        return
    try:
        await asyncio.to_thread(state.engine.engine.grammar_compiler.grammar, so)
    except ValueError as e:
        raise APIError(400, str(e), "structured_outputs") from None


async def _chat_stream(state: ServerState, body: ChatCompletionRequest, batch: _Batch, top: int,
                       plan: ToolPlan):
    tok = state.tokenizer
    head = {"id": batch.id, "object": "chat.completion.chunk", "created": serving.now(),
            "model": state.model_name}
    for j in range(body.n):
        yield {**head, "choices": [{"index": j, "delta": {"role": "assistant", "content": _echoed(body)},
                                    "logprobs": None, "finish_reason": None}]}
    done: set[int] = set()
    sent: dict[int, int] = {}
    token_texts: dict[int, serving.TokenTexts] = {}
    streamers: dict[int, ToolCallStreamer] = {}
    last: dict[int, Choice] = {}
    cached, prompt_ids = [0], [[]]
    async for _, out in batch.outputs():
        cached[0], prompt_ids[0] = out.num_cached_tokens, out.prompt_token_ids
        for c in out.outputs:
            if c.index in done:
                continue
            new = c.token_ids[sent.get(c.index, 0):]
            sent[c.index] = len(c.token_ids)
            last[c.index] = Choice(index=c.index, prompt_token_ids=out.prompt_token_ids, token_ids=c.token_ids)
            if not c.delta_text and not new and not c.finish_reason:
                continue
            lp = None
            if body.logprobs and new:
                lp = serving.chat_logprobs(tok, new, c.logprobs[len(c.logprobs) - len(new):], top,
                                           token_texts.setdefault(c.index, serving.TokenTexts(tok)),
                                           body.return_tokens_as_token_ids)
            finish = c.finish_reason
            if finish:
                done.add(c.index)
            if plan.parser is None:
                delta = {"content": c.delta_text} if c.delta_text or not finish else {}
            else:
                streamer = streamers.setdefault(c.index, ToolCallStreamer(plan.parser, plan.max_calls))
                delta = _tool_delta(streamer.feed(c.delta_text, final=bool(finish)))
                if finish and streamer.has_calls:
                    finish = _tool_finish(finish, plan)
                if not delta and not finish and lp is None:
                    continue
            yield {**head, "choices": [{"index": c.index, "delta": delta, "logprobs": lp,
                                        "finish_reason": finish, "stop_reason": c.stop_reason}]}
    if body.stream_options and body.stream_options.include_usage:
        yield {**head, "choices": [], "usage": serving.usage(list(last.values()), prompt_ids, cached)}


def _tool_delta(d: StreamDelta) -> dict:
    delta: dict = {}
    if d.content:
        delta["content"] = d.content
    if d.tool_calls:
        delta["tool_calls"] = d.tool_calls
    return delta


# ---- shared ----------------------------------------------------------------------------------

def _check_logprobs(state: ServerState, field: str, value: int | None) -> None:
    limit = state.engine.engine.config.max_logprobs
    if value is not None and value > limit:
        raise APIError(400, f"{field} must be <= {limit} (the server's --max-logprobs), got {value}", field)


async def _encode_chat(state: ServerState, messages, add_generation_prompt: bool,
                       template_kwargs: dict | None = None, tools: list[dict] | None = None,
                       body: ChatCompletionRequest | None = None) -> list[int]:
    """Messages through the chat template, rendered in a worker thread (a template is code: the event
    loop never runs it); what is wrong with them (empty, non-text parts, a template that raises) is
    a 400 naming messages."""
    if not messages:
        raise APIError(400, "messages is empty: give at least one message", "messages")
    kwargs = _template_kwargs(state, template_kwargs)
    if state.config.chat_template is not None:
        kwargs.setdefault("chat_template", state.config.chat_template)
    if tools:
        kwargs["tools"] = tools
    special = False
    if body is not None:
        special = body.add_special_tokens
        if body.continue_final_message:
            kwargs["continue_final_message"] = True
        if body.documents is not None:
            kwargs["documents"] = body.documents
    try:
        return await asyncio.to_thread(state.tokenizer.encode_chat, messages_as_dicts(messages),
                                       add_generation_prompt, special, **kwargs)
    except ValueError as e:
        raise APIError(400, str(e), "messages") from None
    except Exception as e:  # a template that raises on these messages (raise_exception)
        raise APIError(400, f"the chat template rejected the messages: {e}", "messages") from None


def _template_kwargs(state: ServerState, kwargs: dict | None) -> dict:
    """chat_template_kwargs as the template may read them: plain values only, and never a template
    (unless the server trusts its clients' templates) nor tools."""
    out = dict(kwargs or {})
    for key, value in out.items():
        if key in _TEMPLATE_SOURCES and not (key == "chat_template" and state.config.trust_request_chat_template):
            hint = " (start the server with --trust-request-chat-template)" if key == "chat_template" else ""
            raise APIError(400, f"chat_template_kwargs.{key} is not accepted{hint}", "chat_template_kwargs")
        if key != "chat_template" and not isinstance(value, (str, int, float, bool, type(None))):
            raise APIError(400, f"chat_template_kwargs.{key} must be a string, number, boolean or null",
                           "chat_template_kwargs")
    return out


async def _prompt_ids(state: ServerState, prompts: list[str | list[int]],
                      add_special_tokens: bool = True) -> list[list[int]]:
    """Every prompt as token ids, tokenized in a worker thread. A text too long to fit in
    max_model_len tokens whatever it says is refused by its length alone, before any work."""
    for p in prompts:
        if not p:
            raise APIError(400, "prompt is empty: give at least one character or token", "prompt")
        if isinstance(p, str):
            _check_characters(state, len(p), "prompt")
    tok = state.tokenizer
    texts = [p for p in prompts if isinstance(p, str)]
    encoded = iter(await asyncio.to_thread(tok.encode_batch, texts, add_special_tokens) if texts else [])
    return [next(encoded) if isinstance(p, str) else list(p) for p in prompts]


def _check_characters(state: ServerState, num_chars: int, field: str) -> None:
    """A text too long for max_model_len tokens whatever it says, known by its length alone."""
    tok, limit = state.tokenizer, state.engine.engine.max_model_len
    if num_chars > (limit - 1) * tok.max_token_chars:
        raise APIError(400, f"the {field} has {num_chars:,} characters: more than max_model_len {limit} "
                            "tokens of this tokenizer can spell", field)


def _check_fan_out(state: ServerState, num_prompts: int, n: int) -> None:
    """One request may not queue more sequences (prompts x n) than the whole queue holds."""
    limit = state.config.max_queued_requests
    if num_prompts * n > limit:
        raise APIError(400, f"this request asks for {num_prompts * n} sequences ({num_prompts} prompts x "
                            f"n {n}); the server queues at most {limit} (--max-queued-requests)", "n")


def _check_length(state: ServerState, ids: list[int], max_tokens: int | None, field: str,
                  default_note: str = "") -> None:
    """vLLM's rule: the prompt and max_tokens together must fit max_model_len."""
    limit = state.engine.engine.max_model_len
    if len(ids) >= limit:
        raise APIError(400, f"the {field} has {len(ids)} tokens; max_model_len is {limit}, which must "
                            "leave room for at least one generated token", field)
    if max_tokens is not None and len(ids) + max_tokens > limit:
        raise APIError(400, f"this request has {len(ids)} prompt tokens and max_tokens {max_tokens}"
                            f"{default_note}: {len(ids) + max_tokens} is over max_model_len {limit}; "
                            f"shorten the {field} or lower max_tokens", "max_tokens")


def _params(state: ServerState, body, max_tokens, logprobs, prompt_logprobs,
            constraint: StructuredOutputsParams | None = None) -> SamplingParams:
    try:
        return body.sampling_params(state.engine.engine.default_sampling_params(), max_tokens,
                                    logprobs, prompt_logprobs, constraint)
    except ValueError as e:
        raise APIError(400, str(e), str(e).split(" ")[0].split(".")[0]) from None


def _sse(chunks: AsyncIterator[dict]) -> StreamingResponse:
    async def events():
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
        except APIError as e:        # after the stream started: an error event, then the end
            logger.warning("stream ended by an error: %s", e.message)
            error = {"message": e.message, "type": _ERROR_TYPES.get(e.status, "APIError"),
                     "param": e.param, "code": e.status}
            yield f"data: {json.dumps({'error': error}, ensure_ascii=False)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


# ---- running the server ----------------------------------------------------------------------

def run_server(llm_engine: LLMEngine, config: ServerConfig, host: str, port: int,
               log_level: str = "info", graceful_timeout: float = 5.0) -> int:
    import uvicorn

    if not config.api_key and not is_loopback(host):
        logger.warning("listening on %s without an API key: anyone who can reach port %d can use "
                       "this server (set --api-key or TWOSTEP_API_KEY)", host, port)
    app = build_app(llm_engine, config)
    # In-flight requests get graceful_timeout seconds to finish, then are aborted so their
    # streams end properly (finish_reason "abort", [DONE]); uvicorn waits a little longer.
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level.lower(),
                            timeout_graceful_shutdown=graceful_timeout + 5.0)
    server = _QuietSignalsServer(config)
    engine: AsyncEngine = app.state.twostep.engine

    failed: list[BaseException] = []

    async def serve() -> None:
        loop = asyncio.get_running_loop()

        def on_failure(error: BaseException) -> None:   # the engine cannot serve any more: exit
            failed.append(error)
            loop.call_soon_threadsafe(server.request_exit)

        engine.on_failure = on_failure

        def on_signal() -> None:
            if server.should_exit:
                return
            server.request_exit()
            loop.call_later(graceful_timeout, engine.abort_all)

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal)
        await server.serve()

    asyncio.run(serve())
    if failed:
        logger.error("exiting: the engine failed: %s", failed[0])
        return 1
    return 0


class _QuietSignalsServer:
    """uvicorn.Server whose shutdown we trigger from our own signal handlers, so SIGTERM
    ends in a clean exit 0 (uvicorn would re-raise the signal after shutting down)."""

    def __new__(cls, config):
        import uvicorn

        class Server(uvicorn.Server):
            def install_signal_handlers(self) -> None:  # older uvicorn
                pass

            @contextlib.contextmanager
            def capture_signals(self):  # newer uvicorn
                yield

            def request_exit(self) -> None:
                logger.info("shutting down: no new connections, finishing in-flight requests")
                self.should_exit = True

        return Server(config)
