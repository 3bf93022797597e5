"""A chat.completion body as Anthropic's message: content blocks in order (thinking when the model
reasoned, text, tool_use with the parsed arguments), the stop reason, and the usage; and the pieces
of it that the stream (anthropic_stream.py) shares.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from twostep.entrypoints.openai.errors import APIError


@dataclass(frozen=True, slots=True)
class ReplyLimits:
    """What a reply may stop at besides its own end: the request's stop sequences, and the end of
    the context when it leaves fewer tokens than max_tokens asked for (context_room: that many)."""

    stop_sequences: tuple[str, ...] = ()
    context_room: int | None = None


def anthropic_message(chat: dict, limits: ReplyLimits) -> dict:
    choice = chat["choices"][0]
    message = choice["message"]
    content: list[dict] = []
    if message.get("reasoning"):
        content.append({"type": "thinking", "thinking": message["reasoning"], "signature": ""})
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    calls = message.get("tool_calls") or []
    content += [{"type": "tool_use", "id": tool_use_id(call["id"]), "name": call["function"]["name"],
                 "input": json.loads(call["function"]["arguments"])} for call in calls]
    reason, sequence = stop_reason(choice["finish_reason"], choice.get("stop_reason"), bool(calls),
                                   chat["usage"]["completion_tokens"], limits)
    return {"id": message_id(chat["id"]), "type": "message", "role": "assistant", "model": chat["model"],
            "content": content, "stop_reason": reason, "stop_sequence": sequence,
            "usage": message_usage(chat["usage"])}


def message_id(chat_id: str) -> str:
    """Anthropic's "msg_" id for the chat core's "chatcmpl-" one."""
    return "msg_" + chat_id.removeprefix("chatcmpl-")


def tool_use_id(call_id: str) -> str:
    """Anthropic's "toolu_" id for a chat tool call's "call_" one."""
    return "toolu_" + call_id.removeprefix("call_")


def stop_reason(finish_reason: str | None, matched: int | str | None, has_calls: bool, output_tokens: int,
                limits: ReplyLimits) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) for the chat choice's finish_reason and stop_reason (the stop
    string or token it ended on)."""
    if finish_reason == "abort":
        raise APIError(503, "the request was aborted: the server is shutting down")
    if finish_reason == "length":
        at_context_end = limits.context_room is not None and output_tokens >= limits.context_room
        return ("model_context_window_exceeded" if at_context_end else "max_tokens"), None
    if has_calls:
        return "tool_use", None
    if isinstance(matched, str) and matched in limits.stop_sequences:
        return "stop_sequence", matched
    return "end_turn", None


def message_usage(usage: dict) -> dict:
    """Anthropic's usage: the prefix cache's hit is cache_read_input_tokens and input_tokens the
    rest of the prompt (clients add them up for the prompt's size); with reasoning, how many of the
    output tokens were thinking."""
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    out = {"input_tokens": usage["prompt_tokens"] - cached, "output_tokens": usage["completion_tokens"],
           "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}
    details = usage.get("completion_tokens_details")
    if details is not None:       # with a reasoning parser
        out["output_tokens_details"] = {"thinking_tokens": details["reasoning_tokens"]}
    return out
