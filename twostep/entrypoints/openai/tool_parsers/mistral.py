"""Mistral tool calls: [TOOL_CALLS] followed by a JSON array of calls, or by name[ARGS]{...}.

    Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "f", "arguments": {}}]
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]f[ARGS]{}

Text before a marker (and after the calls that follow it) is content (see base for whitespace).
In the array form each object is a call (complete once the object is closed and valid); in the
newer form the name runs up to [ARGS] (letters, digits, "_", "-", "."), and the arguments are the
JSON value after it. Text after [TOOL_CALLS] that fits neither form is content, and so is the text
from the first character that breaks an array or an arguments value; the call that broke stays with
complete=False and its arguments as far as read. The markers are special tokens.
"""
from __future__ import annotations

import re

from twostep.entrypoints.openai.tool_parsers.base import ParsedOutput, ToolCallDraft, ToolParser
from twostep.entrypoints.openai.tool_parsers.content import cut_partial_marker, join_content
from twostep.entrypoints.openai.tool_parsers.json_calls import scan_call_array
from twostep.entrypoints.openai.tool_parsers.json_scan import is_json, scan_value, skip_ws, value_prefix

MARKER = "[TOOL_CALLS]"
ARGS = "[ARGS]"
_NAME = re.compile(r"[\w.\-]+")


def _parse_named(text: str, pos: int, calls: list[ToolCallDraft], final: bool) -> int:
    """The name[ARGS]{...} call at pos, appended to calls; returns where reading goes on."""
    args_at = text.find(ARGS, pos)
    if args_at == -1:
        waiting = not final and _NAME.fullmatch(cut_partial_marker(text[pos:], ARGS))
        return len(text) if waiting else pos
    name = text[pos:args_at]
    if not _NAME.fullmatch(name):
        return pos
    start = skip_ws(text, args_at + len(ARGS))
    if start >= len(text):
        calls.append(ToolCallDraft(name, "", False))
        return start
    value = scan_value(text, start)
    arguments = value_prefix(text, start, value)
    calls.append(ToolCallDraft(name, arguments, value.end is not None and is_json(arguments)))
    return value.resume(len(text))


def _parse_segment(text: str, pos: int, calls: list[ToolCallDraft], final: bool) -> int:
    """The calls after the marker that ends at pos, appended to calls; returns where reading goes on."""
    start = skip_ws(text, pos)
    if start >= len(text):
        return start
    if text[start] == "[":
        array = scan_call_array(text, start)
        calls.extend(array.drafts)
        return array.scan.resume(len(text))
    return _parse_named(text, start, calls, final)


class MistralToolParser(ToolParser):
    name = "mistral"
    needs_special_tokens = True

    def parse(self, text: str, final: bool) -> ParsedOutput:
        pieces: list[str] = []
        calls: list[ToolCallDraft] = []
        pos = 0
        while (start := text.find(MARKER, pos)) != -1:
            pieces.append(text[pos:start])
            pos = _parse_segment(text, start + len(MARKER), calls, final)
        tail = text[pos:]
        pieces.append(tail if final else cut_partial_marker(tail, MARKER))
        return ParsedOutput(join_content(pieces, final), calls)
