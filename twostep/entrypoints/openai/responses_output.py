"""The response object of the Responses API and its output items, built from what the chat core
answers: the reasoning (an item of its own, first), the text (a message item), the tool calls (a
function_call item each), usage renamed, and the request's settings echoed.

Streamed and not, the same rules make the items, so a streamed response ends equal to the one
answered whole: an item is "incomplete" only when it is the last one of a response cut by
max_output_tokens.
"""
from __future__ import annotations

import uuid

from twostep.entrypoints.openai import serving
from twostep.entrypoints.openai.responses_api_protocol import ResponsesRequest, TextConfig


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def reasoning_item(item_id: str, text: str, status: str) -> dict:
    """Reasoning as its text (the chain of thought itself, which can be sent back as input); no
    summary is generated."""
    return {"id": item_id, "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": status}


def message_item(item_id: str, text: str, status: str) -> dict:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [output_text(text)]}


def output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": []}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def chat_reasoning(delta_or_message: dict) -> str | None:
    """The chat core gives reasoning under two names (reasoning and vLLM's older
    reasoning_content), the same text."""
    return delta_or_message.get("reasoning") or delta_or_message.get("reasoning_content")


def output_items(message: dict, finish_reason: str | None) -> list[dict]:
    """A chat.completion message as output items."""
    items = []
    reasoning = chat_reasoning(message)
    if reasoning:
        items.append(reasoning_item(new_id("rs"), reasoning, "completed"))
    if message.get("content"):
        items.append(message_item(new_id("msg"), message["content"], "completed"))
    for call in message.get("tool_calls") or []:
        items.append(function_call_item(new_id("fc"), call["id"], call["function"]["name"],
                                        call["function"]["arguments"], "completed"))
    if items and is_cut(finish_reason):
        items[-1]["status"] = "incomplete"
    return items


def is_cut(finish_reason: str | None) -> bool:
    return finish_reason == "length"


def response_usage(chat_usage: dict | None) -> dict | None:
    """A chat usage in the Responses API's names."""
    if chat_usage is None:
        return None
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    reasoning = (chat_usage.get("completion_tokens_details") or {}).get("reasoning_tokens", 0)
    return {"input_tokens": chat_usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": chat_usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": chat_usage["total_tokens"]}


def response_head(body: ResponsesRequest, model_name: str) -> dict:
    """The response before any output: its id, and the request's settings as OpenAI echoes them."""
    return {"id": new_id("resp"), "object": "response", "created_at": serving.now(), "status": "in_progress",
            "incomplete_details": None, "error": None, "model": model_name, "output": [], "usage": None,
            "instructions": body.instructions,
            "tools": [t.model_dump() for t in body.tools or []],
            "tool_choice": _dump(body.tool_choice) if body.tool_choice is not None else "auto",
            "parallel_tool_calls": body.parallel_tool_calls,
            "text": (body.text or TextConfig()).model_dump(by_alias=True, exclude_none=True),
            "reasoning": body.reasoning.model_dump() if body.reasoning else None,
            "temperature": body.temperature, "top_p": body.top_p, "max_output_tokens": body.max_output_tokens,
            "previous_response_id": body.previous_response_id, "store": body.store,
            "metadata": dict(body.metadata or {}), "user": body.user, "truncation": "disabled",
            "background": False}


def _dump(value):
    return value if isinstance(value, str) else value.model_dump()


def finished_response(head: dict, output: list[dict], finish_reason: str | None, chat_usage: dict | None) -> dict:
    """The response once generation ended: completed, incomplete (cut by max_output_tokens), or
    failed (aborted: the server shut down under it)."""
    response = {**head, "output": output, "usage": response_usage(chat_usage), "status": "completed"}
    if is_cut(finish_reason):
        response.update(status="incomplete", incomplete_details={"reason": "max_output_tokens"})
    elif finish_reason == "abort":
        response.update(status="failed", error={"code": "server_error",
                                                "message": "the request was aborted (the server is shutting down)"})
    return response


def failed_response(head: dict, output: list[dict], code: str, message: str) -> dict:
    return {**head, "output": output, "status": "failed", "error": {"code": code, "message": message}}
