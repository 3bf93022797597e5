"""The text a request is routed by: what its prompt will start with, read from the JSON body of any of
the APIs (completions, chat, Responses, Anthropic Messages, embeddings, score, rerank).

What a chat template puts first comes first here too: tools and system instructions, then the
messages in order, each serialized whole, so two requests whose prompts share a prefix (a shared
system prompt, the earlier turns of a conversation, a RAG template) share a prefix of this text.
"""
from __future__ import annotations

import json

# body keys in the order a prompt is built from them
_LEADING = ("tools", "system", "instructions")
_PROMPT = ("messages", "input", "prompt", "query", "text_1", "text", "documents")


def json_object(body: bytes) -> dict:
    """The body as a JSON object; {} where it is not one (the replica answers the error)."""
    try:
        data = json.loads(body) if body else None
    except (ValueError, RecursionError):
        return {}
    return data if isinstance(data, dict) else {}


def routing_text(data: dict) -> str:
    return "".join(_flat(data[key]) for key in (*_LEADING, *_PROMPT) if key in data)


def _flat(value) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return " ".join(map(str, value))        # a prompt of token ids
    if isinstance(value, list):
        return "\x1e".join(_flat(v) for v in value) + "\x1e"
    try:
        return json.dumps(value, ensure_ascii=False, sort_keys=True)
    except (TypeError, ValueError, RecursionError):
        return ""


def previous_response_id(data: dict) -> str | None:
    """A Responses API request that continues a stored response (it lives on one replica)."""
    value = data.get("previous_response_id")
    return value if isinstance(value, str) else None
