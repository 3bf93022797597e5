"""POST /v1/responses (OpenAI's Responses API), GET and DELETE /v1/responses/{id}, on top of the chat
core: a request's instructions and input items become chat messages (a stored response named as
previous_response_id first), its settings a ChatCompletionRequest; run_chat runs it, and its answer
(or chunk stream) comes back as the response object (or its typed events).

Items to messages: instructions are a system message first; a developer message is a system one;
reasoning, assistant text and function calls that follow one another are one assistant turn (its
reasoning, content and tool_calls, as the chat template takes them); a function_call_output is a
tool message naming its call (and the function, where the call is in the conversation).
"""
from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import ValidationError

from twostep.entrypoints.openai.chat import run_chat
from twostep.entrypoints.openai.errors import APIError, error_responses
from twostep.entrypoints.openai.protocol import ChatCompletionRequest
from twostep.entrypoints.openai.responses_api_protocol import (INPUT_ITEM, DeletedResponse, FunctionCallItem,
                                                               FunctionCallOutputItem, MessageItem, ReasoningItem,
                                                               ResponseObject, ResponsesRequest, TextFormatJsonSchema)
from twostep.entrypoints.openai.responses_output import finished_response, output_items, response_head
from twostep.entrypoints.openai.responses_store import ResponseStore, StoredResponse
from twostep.entrypoints.openai.responses_stream import events_response, response_events
from twostep.entrypoints.openai.routes import note_ignored
from twostep.entrypoints.openai.state import ServerState

# the chat core's names for what a Responses request calls otherwise (in its errors' param)
_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format"}


def add_responses_routes(app: FastAPI, state: ServerState) -> None:
    store = ResponseStore(state.config.max_stored_responses)

    @app.post("/v1/responses", response_model=None, responses={
        200: {"model": ResponseObject, "description": "the response (JSON), or with stream: true its typed "
              "events as server-sent events", "content": {"text/event-stream": {"schema": {"type": "string"}}}},
        **error_responses(400, 404, 413, 503)})
    async def create(body: ResponsesRequest, raw: Request, response: Response):
        return note_ignored(body, response, await create_response(state, store, body, raw))

    @app.get("/v1/responses/{response_id}", response_model=None,
             responses={200: {"model": ResponseObject}, **error_responses(400, 404)})
    async def retrieve(response_id: str, stream: bool = False):
        if stream:
            raise APIError(400, "stream: true replays background responses, which this server does not run",
                           "stream")
        return _stored(store, response_id, "response_id").response

    @app.delete("/v1/responses/{response_id}", response_model=None,
                responses={200: {"model": DeletedResponse}, **error_responses(404)})
    async def delete(response_id: str):
        if not store.delete(response_id):
            raise _not_found(store, response_id, "response_id")
        return {"id": response_id, "object": "response", "deleted": True}


async def create_response(state: ServerState, store: ResponseStore, body: ResponsesRequest, raw: Request):
    conversation = (*_earlier(store, body.previous_response_id), *body.input_items())
    if not conversation:
        raise APIError(400, "input is empty: give a message or items (or a previous_response_id)", "input")
    chat = _chat_request(body, conversation)
    head = response_head(body, state.model_name)

    def finished(response: dict) -> None:
        if body.store:
            output = tuple(INPUT_ITEM.validate_python(item) for item in response["output"])
            store.put(StoredResponse(response, (*conversation, *output)))

    try:
        result = await run_chat(state, chat, raw)
    except APIError as e:
        raise APIError(e.status, e.message, _PARAMS.get(e.param, e.param)) from None
    if body.stream:
        return events_response(response_events(head, result, finished))
    choice = result["choices"][0]
    response = finished_response(head, output_items(choice["message"], choice["finish_reason"]),
                                 choice["finish_reason"], result["usage"])
    finished(response)
    return response


def _earlier(store: ResponseStore, previous_response_id: str | None) -> tuple:
    """The conversation a follow-up continues: the previous response's input and output."""
    if previous_response_id is None:
        return ()
    return _stored(store, previous_response_id, "previous_response_id").conversation


def _stored(store: ResponseStore, response_id: str, param: str) -> StoredResponse:
    stored = store.get(response_id)
    if stored is None:
        raise _not_found(store, response_id, param)
    return stored


def _not_found(store: ResponseStore, response_id: str, param: str) -> APIError:
    return APIError(404, f"no stored response {response_id!r}: responses are kept only with store: true, the "
                         f"last {store.max_size} of them (--max-stored-responses)", param)


# ---- a Responses request as a chat request ----------------------------------------------------------

def _chat_request(body: ResponsesRequest, conversation) -> ChatCompletionRequest:
    fields = {"model": body.model, "messages": chat_messages(body.instructions, conversation),
              "max_completion_tokens": body.max_output_tokens, "temperature": body.temperature,
              "top_p": body.top_p, "top_k": body.top_k, "seed": body.seed, "stop": body.stop, "user": body.user,
              "parallel_tool_calls": body.parallel_tool_calls, "structured_outputs": body.structured_outputs,
              "chat_template_kwargs": _template_kwargs(body), "response_format": _response_format(body)}
    if body.tools:
        fields["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                           for t in body.tools]
    if body.tool_choice is not None:
        choice = body.tool_choice
        fields["tool_choice"] = choice if isinstance(choice, str) else {"type": "function",
                                                                        "function": {"name": choice.name}}
    if body.stream:
        fields.update(stream=True, stream_options={"include_usage": True})
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as e:      # a value the chat request bounds tighter than this one
        err = e.errors()[0]
        where = ".".join(str(x) for x in err.get("loc", ()))
        raise APIError(400, f"{where}: {err.get('msg')}", _PARAMS.get(where, where)) from None


def _template_kwargs(body: ResponsesRequest) -> dict | None:
    kwargs = dict(body.chat_template_kwargs or {})
    if body.reasoning is not None and body.reasoning.effort is not None:
        kwargs["reasoning_effort"] = body.reasoning.effort
    return kwargs or None


def _response_format(body: ResponsesRequest) -> dict | None:
    fmt = body.text.format if body.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if not isinstance(fmt, TextFormatJsonSchema):
        return {"type": fmt.type}
    schema = {"name": fmt.name, "schema": fmt.json_schema, "description": fmt.description, "strict": fmt.strict}
    return {"type": "json_schema", "json_schema": {k: v for k, v in schema.items() if v is not None}}


def chat_messages(instructions: str | None, items) -> list[dict]:
    """Instructions and input items as chat messages."""
    messages: list[dict] = [{"role": "system", "content": instructions}] if instructions else []
    function_names: dict[str, str] = {}
    for item in items:
        if isinstance(item, MessageItem):
            _add_message(messages, item)
        elif isinstance(item, FunctionCallItem):
            function_names[item.call_id] = item.name
            _assistant_turn(messages).setdefault("tool_calls", []).append(
                {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}})
        elif isinstance(item, FunctionCallOutputItem):
            name = function_names.get(item.call_id)
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text(),
                             **({"name": name} if name else {})})
        elif isinstance(item, ReasoningItem):
            _add_reasoning(messages, item.text())
    for m in messages:      # a turn of reasoning alone has empty content, not none
        if m["role"] == "assistant" and m["content"] is None and not m.get("tool_calls"):
            m["content"] = ""
    return messages


def _add_message(messages: list[dict], item: MessageItem) -> None:
    if item.role == "assistant":
        last = messages[-1] if messages else None
        if last is not None and _only_reasoning(last):
            last["content"] = item.text()
            return
    role = "system" if item.role == "developer" else item.role
    messages.append({"role": role, "content": item.text()})


def _add_reasoning(messages: list[dict], text: str) -> None:
    """Reasoning opens an assistant turn: the text and calls that follow are its content and calls."""
    messages.append({"role": "assistant", "content": None, "reasoning": text})


def _only_reasoning(message: dict) -> bool:
    return message["role"] == "assistant" and message["content"] is None and not message.get("tool_calls")


def _assistant_turn(messages: list[dict]) -> dict:
    """The assistant turn a function call belongs to: the one just before, else a new one."""
    if messages and messages[-1]["role"] == "assistant":
        return messages[-1]
    messages.append({"role": "assistant", "content": None})
    return messages[-1]
