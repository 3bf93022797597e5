"""A streamed response (stream: true): the chat core's chunks turned into the Responses API's typed
server-sent events, in the order OpenAI's SDK accumulates them (and vLLM sends them):

    response.created, response.in_progress,
    per output item, one after the other:
      reasoning:     output_item.added, content_part.added, reasoning_text.delta..., reasoning_text.done,
                     content_part.done, output_item.done
      message:       output_item.added, content_part.added, output_text.delta..., output_text.done,
                     content_part.done, output_item.done
      function call: output_item.added, function_call_arguments.delta..., function_call_arguments.done,
                     output_item.done
    response.completed (response.incomplete when cut by max_output_tokens)

Each event has a `type` and a rising `sequence_number`; each is sent as `event: <type>` and
`data: <json>`. An error once the stream started ends it with an `error` event and
response.failed.
"""
from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from fastapi.responses import StreamingResponse

from twostep.entrypoints.openai.errors import APIError
from twostep.entrypoints.openai.responses_output import (chat_reasoning, failed_response, finished_response,
                                                         function_call_item, is_cut, message_item, new_id,
                                                         output_text, reasoning_item)

logger = logging.getLogger(__name__)

_FINAL_EVENTS = {"completed": "response.completed", "incomplete": "response.incomplete",
                 "failed": "response.failed"}


@dataclass
class _OpenItem:
    """The output item being streamed: its text (or a call's arguments) so far."""

    kind: str                   # "reasoning", "message" or "function_call"
    item_id: str
    output_index: int
    text: str = ""
    call_id: str = ""
    name: str = ""

    def item(self, status: str) -> dict:
        if self.kind == "reasoning":
            return reasoning_item(self.item_id, self.text, status)
        if self.kind == "message":
            return message_item(self.item_id, self.text, status)
        return function_call_item(self.item_id, self.call_id, self.name, self.text, status)


class ResponseEvents:
    """Chat chunk deltas in, the response's events out; the output items as they close."""

    def __init__(self, head: dict) -> None:
        self.head = head
        self.sequence = 0
        self.output: list[dict] = []
        self.open: _OpenItem | None = None

    def event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def start(self) -> list[dict]:
        return [self.event("response.created", response=self.head),
                self.event("response.in_progress", response=self.head)]

    def feed(self, delta: dict) -> list[dict]:
        events = []
        reasoning = chat_reasoning(delta)
        if reasoning:
            events += self._text("reasoning", reasoning)
        if delta.get("content"):
            events += self._text("message", delta["content"])
        for call in delta.get("tool_calls") or []:
            events += self._call(call)
        return events

    def end(self, finish_reason: str | None, chat_usage: dict | None) -> tuple[list[dict], dict]:
        """The last events and the finished response."""
        events = self._close("incomplete" if is_cut(finish_reason) else "completed")
        final = finished_response(self.head, self.output, finish_reason, chat_usage)
        return events + [self.event(_FINAL_EVENTS[final["status"]], response=final)], final

    def fail(self, error: APIError) -> list[dict]:
        code = "server_error" if error.status >= 500 else "invalid_request_error"
        events = self._close("incomplete")
        final = failed_response(self.head, self.output, code, error.message)
        return events + [self.event("error", code=code, message=error.message, param=error.param),
                         self.event("response.failed", response=final)]

    # ---- the items -------------------------------------------------------------------------------

    def _text(self, kind: str, text: str) -> list[dict]:
        events = [] if self.open is not None and self.open.kind == kind else self._close("completed") + self._open(kind)
        item = self.open
        item.text += text
        delta = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        return events + [self.event(delta, item_id=item.item_id, output_index=item.output_index, content_index=0,
                                    delta=text, **extra)]

    def _call(self, call: dict) -> list[dict]:
        """A chat tool-call delta: the first of a call has its id and name, the rest arguments."""
        function = call.get("function") or {}
        events = []
        if call.get("id"):
            events = self._close("completed") + self._open("function_call", call["id"], function.get("name", ""))
        arguments = function.get("arguments")
        if arguments and self.open is not None and self.open.kind == "function_call":
            self.open.text += arguments
            events.append(self.event("response.function_call_arguments.delta", item_id=self.open.item_id,
                                     output_index=self.open.output_index, delta=arguments))
        return events

    def _open(self, kind: str, call_id: str = "", name: str = "") -> list[dict]:
        prefix = {"reasoning": "rs", "message": "msg", "function_call": "fc"}[kind]
        item = self.open = _OpenItem(kind, new_id(prefix), len(self.output), call_id=call_id, name=name)
        added = item.item("in_progress")
        if kind == "function_call":
            return [self.event("response.output_item.added", output_index=item.output_index, item=added)]
        part = {"type": "reasoning_text", "text": ""} if kind == "reasoning" else output_text("")
        return [self.event("response.output_item.added", output_index=item.output_index, item={**added, "content": []}),
                self.event("response.content_part.added", item_id=item.item_id, output_index=item.output_index,
                           content_index=0, part=part)]

    def _close(self, status: str) -> list[dict]:
        item, self.open = self.open, None
        if item is None:
            return []
        done = item.item(status)
        self.output.append(done)
        where = {"item_id": item.item_id, "output_index": item.output_index}
        if item.kind == "function_call":
            events = [self.event("response.function_call_arguments.done", **where, arguments=item.text)]
        elif item.kind == "reasoning":
            events = [self.event("response.reasoning_text.done", **where, content_index=0, text=item.text),
                      self.event("response.content_part.done", **where, content_index=0, part=done["content"][0])]
        else:
            events = [self.event("response.output_text.done", **where, content_index=0, text=item.text, logprobs=[]),
                      self.event("response.content_part.done", **where, content_index=0, part=done["content"][0])]
        return events + [self.event("response.output_item.done", output_index=item.output_index, item=done)]


async def response_events(head: dict, chunks: AsyncIterator[dict],
                          on_finished: Callable[[dict], None]) -> AsyncIterator[dict]:
    """The events of one streamed response. on_finished gets the finished response before the
    last event goes out (so a client that has read response.completed finds it stored)."""
    events = ResponseEvents(head)
    for event in events.start():
        yield event
    finish, usage = None, None
    try:
        async for chunk in chunks:
            usage = chunk.get("usage") or usage
            for choice in chunk["choices"]:
                for event in events.feed(choice["delta"]):
                    yield event
                finish = choice.get("finish_reason") or finish
    except APIError as e:
        logger.warning("response stream ended by an error: %s", e.message)
        for event in events.fail(e):
            yield event
        return
    last, final = events.end(finish, usage)
    on_finished(final)
    for event in last:
        yield event


def events_response(events: AsyncIterator[dict]) -> StreamingResponse:
    async def lines():
        async for event in events:
            yield f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"

    return StreamingResponse(lines(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
