"""A chat completion's chunk stream as Anthropic's Messages stream: server-sent events with `event:`
lines, in the order its SDKs accumulate them into the message a non-streamed call returns.

message_start (the message, empty, with the prompt's tokens), then per content block in order
(thinking, text, tool_use ...) content_block_start, its deltas (thinking_delta, text_delta,
input_json_delta) and content_block_stop; then message_delta (stop_reason, stop_sequence and the
usage, prefix-cache hit included) and message_stop. An error after the stream started is an `error`
event, and the stream ends there.
"""
from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse

from twostep.entrypoints.openai.anthropic_from_chat import ReplyLimits, message_usage, stop_reason, tool_use_id
from twostep.entrypoints.openai.errors import APIError, anthropic_error_body

logger = logging.getLogger(__name__)

Event = tuple[str, dict]


def anthropic_sse_response(events: AsyncIterator[Event]) -> StreamingResponse:
    async def lines():
        try:
            async for name, data in events:
                yield _event(name, data)
        except APIError as e:        # after the stream started: an error event ends it
            logger.warning("stream ended by an error: %s", e.message)
            yield _event("error", anthropic_error_body(e.status, e.message)[1])

    return StreamingResponse(lines(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _event(name: str, data: dict) -> str:
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


async def message_events(chunks: AsyncIterator[dict], message_id: str, model: str, input_tokens: int,
                         limits: ReplyLimits) -> AsyncIterator[Event]:
    """The Anthropic events of one chat chunk stream (one choice, stream_options.include_usage)."""
    blocks = _Blocks()
    usage = {"input_tokens": input_tokens, "output_tokens": 0, "cache_read_input_tokens": 0,
             "cache_creation_input_tokens": 0}
    yield "message_start", {"type": "message_start", "message": {
        "id": message_id, "type": "message", "role": "assistant", "model": model, "content": [],
        "stop_reason": None, "stop_sequence": None, "usage": usage}}
    finish, matched = None, None
    async for chunk in chunks:
        if not chunk["choices"]:                 # the last chunk: the usage
            for event in blocks.close():
                yield event
            reason, sequence = stop_reason(finish, matched, blocks.has_calls, chunk["usage"]["completion_tokens"],
                                           limits)
            yield "message_delta", {"type": "message_delta",
                                    "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                    "usage": message_usage(chunk["usage"])}
            yield "message_stop", {"type": "message_stop"}
            return
        choice = chunk["choices"][0]
        for event in blocks.feed(choice["delta"]):
            yield event
        if choice.get("finish_reason"):
            finish, matched = choice["finish_reason"], choice.get("stop_reason")


class _Blocks:
    """The content blocks as they stream: one open at a time, a new kind (or a new tool call)
    closing the open one."""

    def __init__(self) -> None:
        self.count = 0                   # blocks started
        self.open: str | None = None     # the open block's kind
        self.calls: dict[int, int] = {}  # chat's tool-call index -> block index
        self.has_calls = False

    def feed(self, delta: dict) -> list[Event]:
        events: list[Event] = []
        if delta.get("reasoning"):
            events += self._into("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            events.append(self._delta({"type": "thinking_delta", "thinking": delta["reasoning"]}))
        if delta.get("content"):
            events += self._into("text", {"type": "text", "text": ""})
            events.append(self._delta({"type": "text_delta", "text": delta["content"]}))
        for call in delta.get("tool_calls") or []:
            function = call.get("function") or {}
            if call.get("id") is not None:
                events += self._start("tool_use", {"type": "tool_use", "id": tool_use_id(call["id"]),
                                                   "name": function.get("name"), "input": {}})
                self.calls[call["index"]] = self.count - 1
                self.has_calls = True
            if function.get("arguments"):
                events.append(self._delta({"type": "input_json_delta", "partial_json": function["arguments"]},
                                          self.calls[call["index"]]))
        return events

    def close(self) -> list[Event]:
        if self.open is None:
            return []
        self.open = None
        return [("content_block_stop", {"type": "content_block_stop", "index": self.count - 1})]

    def _into(self, kind: str, block: dict) -> list[Event]:
        return [] if self.open == kind else self._start(kind, block)

    def _start(self, kind: str, block: dict) -> list[Event]:
        events = self.close()
        self.open, self.count = kind, self.count + 1
        events.append(("content_block_start", {"type": "content_block_start", "index": self.count - 1,
                                               "content_block": block}))
        return events

    def _delta(self, delta: dict, index: int | None = None) -> Event:
        return "content_block_delta", {"type": "content_block_delta",
                                       "index": self.count - 1 if index is None else index, "delta": delta}
