"""Anthropic's Messages API on the chat core: POST /v1/messages (streamed or not) and
POST /v1/messages/count_tokens, as Claude Code, the anthropic SDKs and LangChain's ChatAnthropic
call them. A request becomes a chat request (anthropic_to_chat.py), runs through run_chat, and its
result comes back as a message (anthropic_from_chat.py) or as Anthropic's events (anthropic_stream.py).
Errors on these routes take Anthropic's shape (errors.py); the API key may come as x-api-key
(middleware.py).

The prompt is counted before it runs (count_tokens' count): a stream's message_start reports it
before the engine does, and a max_tokens past the context's end is cut to what the context leaves.
"""
from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import Response

from twostep.entrypoints.openai.anthropic_from_chat import ReplyLimits, anthropic_message, message_id
from twostep.entrypoints.openai.anthropic_protocol import (AnthropicErrorResponse, CountTokensRequest,
                                                          CountTokensResponse, MessageResponse, MessagesRequest)
from twostep.entrypoints.openai.anthropic_stream import anthropic_sse_response, message_events
from twostep.entrypoints.openai.anthropic_to_chat import chat_request
from twostep.entrypoints.openai.chat import run_chat
from twostep.entrypoints.openai.errors import APIError
from twostep.entrypoints.openai.protocol import ChatCompletionRequest
from twostep.entrypoints.openai.request_checks import check_model, encode_messages
from twostep.entrypoints.openai.routes import note_ignored
from twostep.entrypoints.openai.state import ServerState
from twostep.entrypoints.openai.tool_choice import ToolChoiceError, plan_tools

_ERRORS = {400: "invalid request", 401: "missing or wrong API key", 404: "no such model",
           413: "request body too large", 529: "overloaded: the server's queue is full"}


def add_anthropic_routes(app: FastAPI, state: ServerState) -> None:
    keyed = (401,) if state.config.api_key else ()

    @app.post("/v1/messages", response_model=None, responses={
        200: {"model": MessageResponse, "description": "the message (JSON), or with stream: true Anthropic's "
              "server-sent events", "content": {"text/event-stream": {"schema": {"type": "string"}}}},
        **_errors(400, *keyed, 404, 413, 529)})
    async def messages(body: MessagesRequest, raw: Request, response: Response):
        return note_ignored(body, response, await create_message(state, body, raw))

    @app.post("/v1/messages/count_tokens", response_model=None,
              responses={200: {"model": CountTokensResponse}, **_errors(400, *keyed, 404, 413)})
    async def count_tokens(body: CountTokensRequest, response: Response):
        check_model(state, body.model)
        count = await prompt_tokens(state, chat_request(body))
        return note_ignored(body, response, {"input_tokens": count})


def _errors(*codes: int) -> dict:
    return {code: {"model": AnthropicErrorResponse, "description": _ERRORS[code]} for code in codes}


async def create_message(state: ServerState, body: MessagesRequest, raw: Request):
    check_model(state, body.model)
    chat = chat_request(body)
    input_tokens = await prompt_tokens(state, chat)
    chat, limits = _fit_context(state, chat, input_tokens, body)
    result = await run_chat(state, chat, raw)
    if not body.stream:
        return anthropic_message(result, limits)
    first = await anext(result)                       # the role chunk: it names the request
    return anthropic_sse_response(message_events(_chained(first, result), message_id(first["id"]),
                                                 first["model"], input_tokens, limits))


def _fit_context(state: ServerState, chat: ChatCompletionRequest, input_tokens: int,
                 body: MessagesRequest) -> tuple[ChatCompletionRequest, ReplyLimits]:
    """Anthropic's rule for a max_tokens past the context's end: the reply may run to that end, and
    stops there with model_context_window_exceeded (Claude Code asks for 32,000 whatever the prompt).
    A prompt that leaves no room at all is still refused (run_chat's check)."""
    room = state.engine.engine.max_model_len - input_tokens
    stops = tuple(body.stop_sequences or ())
    if room < 1 or body.max_tokens <= room:
        return chat, ReplyLimits(stops)
    return chat.model_copy(update={"max_tokens": room}), ReplyLimits(stops, room)


async def _chained(first: dict, rest):
    yield first
    async for chunk in rest:
        yield chunk


async def prompt_tokens(state: ServerState, chat: ChatCompletionRequest) -> int:
    """The prompt's length as run_chat encodes it: the messages through the template with the
    tools (whatever tool_choice will do with them)."""
    try:
        tools = plan_tools(chat.model_copy(update={"tool_choice": "none"}), None).template_tools
    except ToolChoiceError as e:
        raise APIError(400, str(e), e.param) from None
    ids = await encode_messages(state, chat.messages, chat.add_generation_prompt, chat.chat_template_kwargs,
                                tools, chat)
    return len(chat.truncate(ids))
