"""What a tool-call parser returns, the contract it keeps, and the two ways the server uses it.

A parser reads the text a model generated and splits it into *content* (text outside the
tool-call markup) and *calls*. It is a pure function of the whole text: it keeps no state, and the
streaming side re-parses the text from the start on every delta (outputs are short), which makes
the result independent of how the text was chunked.

Contract (every parser): for any text T and any prefix P of T, ``parse(P, final=False)`` is
*consistent* with ``parse(T, final=False)`` and with ``parse(T, final=True)``:

- its content is a prefix of theirs;
- it has no more calls than they do;
- each of its calls' name, once not None, is the same in theirs;
- each of its calls' arguments is a prefix of theirs.

With ``final=False`` a parser holds back trailing text that could still turn out to be markup (the
``<tool`` of ``<tool_call>``, or the whitespace the format puts before markup): it is not content
yet. With ``final=True`` the text is complete: held-back text that never became markup is content,
and an unclosed call is reported as far as it got (its arguments as read, ``complete=False`` unless
its JSON is already whole). A call whose markup closed but whose JSON is invalid stays a call with
``complete=False`` (its arguments as written), so that it still agrees with what was streamed.

Content conventions (all parsers): whitespace touching the markup is dropped (the text before a
call is right-stripped, the text after one left-stripped) and the pieces of text between calls are
joined with a newline; text with no markup at all is content as it is. When there are calls and no
other text, content is "".
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field, replace
from typing import ClassVar


@dataclass
class ToolCallDraft:
    """One call as parsed so far."""

    name: str | None  # None until the whole name has been read
    arguments: str  # the arguments' JSON text read so far (always a prefix of the final text)
    complete: bool  # the call's markup is closed and arguments is valid JSON (json.loads works)


@dataclass
class ParsedOutput:
    content: str  # text outside the tool-call markup
    calls: list[ToolCallDraft] = field(default_factory=list)


class ToolParser:
    """Base class of the parsers; see the module docstring for the contract of parse."""

    name: ClassVar[str]  # the --tool-call-parser value
    # True when the markup is a special token that detokenizing with skip_special_tokens=True drops
    needs_special_tokens: ClassVar[bool] = False
    # True when the calls are harmony messages of their own (gpt-oss): the parser reads the whole output,
    # channels and all, instead of the answer the reasoning parser leaves
    reads_harmony: ClassVar[bool] = False

    @classmethod
    def for_tools(cls, tools: list[dict]) -> ToolParser:
        """The parser for one request with these tools (OpenAI function tools, as the chat template
        sees them). Formats that write JSON need no tools; one that writes raw values
        (qwen3_coder) reads their types from the tools' parameter schemas."""
        return cls()

    def parse(self, text: str, final: bool) -> ParsedOutput:
        raise NotImplementedError


@dataclass
class ToolCall:
    """A call as the API returns it: arguments is the JSON text of the arguments."""

    id: str
    name: str
    arguments: str


def new_call_id() -> str:
    """A fresh call id: "call_" and 24 random hex characters."""
    return "call_" + uuid.uuid4().hex[:24]


def extract_tool_calls(parser: ToolParser, text: str) -> tuple[str | None, list[ToolCall]]:
    """Content (None when empty) and the complete calls of a whole output (non-streaming)."""
    parsed = parser.parse(text, final=True)
    calls = [ToolCall(new_call_id(), draft.name, draft.arguments)
             for draft in parsed.calls if draft.complete and draft.name is not None]
    return parsed.content or None, calls


@dataclass
class StreamDelta:
    """What to send for one delta of generated text: new content, and tool_calls entries in the
    shape of OpenAI's chat.completion.chunk ``delta.tool_calls``."""

    content: str
    tool_calls: list[dict]


class ToolCallStreamer:
    """Turns a stream of text deltas into content deltas and OpenAI tool_calls deltas.

    It keeps the whole text, re-parses it on every feed and sends what the parse has beyond what was
    already sent. Call i is announced once its name is complete, with
    ``{"index": i, "id": ..., "type": "function", "function": {"name": ..., "arguments": ""}}``,
    then grows with ``{"index": i, "function": {"arguments": fragment}}`` (never empty). Indexes
    count the calls sent; calls past the first ``max_calls`` are dropped (parallel_tool_calls=false).

    Every call that gets a name is sent, complete or not, so after ``feed(..., final=True)`` the
    calls sent are exactly the named calls of ``parse(text, final=True)`` (the first max_calls of
    them) whatever the chunking, and the content sent is its content. For well-formed output that is
    what extract_tool_calls returns;
    for a malformed call (which extract_tool_calls leaves out) the name and the arguments as far as
    they were read have been sent anyway: best effort, since a sent fragment cannot be taken back.
    """

    def __init__(self, parser: ToolParser, max_calls: int | None = None):
        self.parser = parser
        self.max_calls = max_calls
        self._text = ""
        self._content = ""  # content sent so far
        self._calls: list[ToolCall] = []  # calls sent so far, by index
        self._index: dict[int, int] = {}  # position in the parse -> index of the call sent

    @property
    def calls(self) -> list[ToolCall]:
        """The calls sent so far (arguments as far as sent)."""
        return [replace(call) for call in self._calls]

    @property
    def has_calls(self) -> bool:
        """Whether any call was sent (finish_reason "tool_calls")."""
        return bool(self._calls)

    def feed(self, delta_text: str, final: bool = False) -> StreamDelta:
        self._text += delta_text
        parsed = self.parser.parse(self._text, final)
        return StreamDelta(self._content_delta(parsed.content), self._call_deltas(parsed.calls))

    def _content_delta(self, content: str) -> str:
        if not content.startswith(self._content):  # only a parser breaking the contract gets here
            return ""
        delta, self._content = content[len(self._content):], content
        return delta

    def _call_deltas(self, drafts: list[ToolCallDraft]) -> list[dict]:
        deltas = []
        for position, draft in enumerate(drafts):
            if position not in self._index:
                if draft.name is None or not self._has_room():
                    continue
                deltas.append(self._announce(position, draft.name))
            index = self._index[position]
            call = self._calls[index]
            if len(draft.arguments) > len(call.arguments) and draft.arguments.startswith(call.arguments):
                fragment, call.arguments = draft.arguments[len(call.arguments):], draft.arguments
                deltas.append({"index": index, "function": {"arguments": fragment}})
        return deltas

    def _has_room(self) -> bool:
        return self.max_calls is None or len(self._calls) < self.max_calls

    def _announce(self, position: int, name: str) -> dict:
        index = self._index[position] = len(self._calls)
        call = ToolCall(new_call_id(), name, "")
        self._calls.append(call)
        return {"index": index, "id": call.id, "type": "function", "function": {"name": name, "arguments": ""}}
