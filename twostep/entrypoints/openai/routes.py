"""The routes: /health, /metrics, /v1/models, /tokenize, /detokenize, /version, /tokenizer_info,
and the completions and chat endpoints (completions.py, chat.py), with their OpenAPI entries.
"""
from __future__ import annotations

import asyncio
import json
import logging

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from twostep import __version__ as TWOSTEP_VERSION
from twostep.entrypoints.openai import serving
from twostep.entrypoints.openai.chat import create_chat_completion
from twostep.entrypoints.openai.completions import create_completion
from twostep.entrypoints.openai.errors import APIError, error_response, error_responses
from twostep.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from twostep.entrypoints.openai.request_checks import check_model, encode_messages
from twostep.entrypoints.openai.responses import (
    ChatCompletionResponse,
    CompletionResponse,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeResponse,
    TokenizerInfoResponse,
    VersionResponse,
)
from twostep.entrypoints.openai.state import ServerState

logger = logging.getLogger(__name__)


def _json_or_events(model) -> dict:
    """200: the model as JSON, or server-sent events with stream: true."""
    return {200: {"model": model, "description": "the completion (JSON), or with stream: true its "
                  "chunks as server-sent events ending with data: [DONE]",
                  "content": {"text/event-stream": {"schema": {"type": "string"}}}}}


def add_routes(app: FastAPI, state: ServerState) -> None:
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

    @app.post("/tokenize", response_model=None, responses={200: {"model": TokenizeResponse}, **error_responses(400, 404, 413)})
    async def tokenize(body: TokenizeRequest):
        check_model(state, body.model)
        if body.messages is not None:
            ids = await encode_messages(state, body.messages, body.add_generation_prompt, body.chat_template_kwargs)
        elif body.prompt is not None:
            ids = await asyncio.to_thread(state.tokenizer.encode, body.prompt, body.add_special_tokens)
        else:
            raise APIError(400, "give either prompt or messages", "prompt")
        return {"tokens": ids, "count": len(ids), "max_model_len": state.engine.engine.max_model_len}

    @app.post("/detokenize", response_model=None, responses={200: {"model": DetokenizeResponse}, **error_responses(400, 404, 413)})
    async def detokenize(body: DetokenizeRequest):
        check_model(state, body.model)
        vocab = state.engine.engine.model_config.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token ids out of range [0, {vocab}): {bad[:5]}", "tokens")
        return {"prompt": await asyncio.to_thread(state.tokenizer.decode, body.tokens, False)}

    @app.post("/v1/completions", response_model=None,
              responses={**_json_or_events(CompletionResponse), **error_responses(400, 404, 413, 503)})
    async def completions(body: CompletionRequest, raw: Request, response: Response):
        return note_ignored(body, response, await create_completion(state, body, raw))

    @app.post("/v1/chat/completions", response_model=None,
              responses={**_json_or_events(ChatCompletionResponse), **error_responses(400, 404, 413, 503)})
    async def chat(body: ChatCompletionRequest, raw: Request, response: Response):
        return note_ignored(body, response, await create_chat_completion(state, body, raw))

    @app.get("/v1/models/{model_id:path}", response_model=None, responses={200: {"model": ModelCard},
                                                                       **error_responses(404)})
    async def model(model_id: str):
        check_model(state, model_id)
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


def note_ignored(body, response: Response, result):
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
