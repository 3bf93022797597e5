"""Hermes-style tool calls (Qwen2.5, Qwen3, Hermes): JSON objects in <tool_call> blocks.

    I'll look that up.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

There may be several blocks; the text outside them is content (see base for whitespace). A block
ends at the first "</tool_call>" after it opens. Inside, the keys may come in either order; the
arguments are the raw JSON text of the "arguments" value. A block is complete when it is closed and
holds exactly one valid call object. Malformed blocks stay calls with complete=False: a body that
is not an object has no name (and is never sent), invalid JSON keeps the name and arguments as far
as they were read. At the end of the output an unclosed block counts as closed (a trailing start of
"</tool_call>" is ignored), so a call cut just before its closing tag is still complete.
"""
from __future__ import annotations

from twostep.entrypoints.openai.tool_parsers.base import ParsedOutput, ToolCallDraft, ToolParser
from twostep.entrypoints.openai.tool_parsers.content import cut_partial_marker, join_content
from twostep.entrypoints.openai.tool_parsers.json_calls import scan_call_object
from twostep.entrypoints.openai.tool_parsers.json_scan import skip_ws

START = "<tool_call>"
END = "</tool_call>"


def _parse_body(body: str, closed: bool) -> ToolCallDraft:
    """The call in a block's body; it can be complete only once the block is closed."""
    i = skip_ws(body, 0)
    if i >= len(body) or body[i] != "{":
        return ToolCallDraft(None, "", False)
    obj = scan_call_object(body, i)
    end = obj.scan.end
    complete = closed and obj.draft.complete and not body[end:].strip()
    return ToolCallDraft(obj.draft.name, obj.draft.arguments, complete)


class HermesToolParser(ToolParser):
    name = "hermes"
    needs_special_tokens = False

    def parse(self, text: str, final: bool) -> ParsedOutput:
        pieces: list[str] = []
        calls: list[ToolCallDraft] = []
        pos = 0
        while (start := text.find(START, pos)) != -1:
            pieces.append(text[pos:start])
            body_start = start + len(START)
            close = text.find(END, body_start)
            if close == -1:
                calls.append(_parse_body(cut_partial_marker(text[body_start:], END), closed=final))
                pos = len(text)
                break
            calls.append(_parse_body(text[body_start:close], closed=True))
            pos = close + len(END)
        tail = text[pos:]
        pieces.append(tail if final else cut_partial_marker(tail, START))
        return ParsedOutput(join_content(pieces, final), calls)
