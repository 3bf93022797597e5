"""Llama 3.1 / 3.2 JSON tool calls: optionally <|python_tag|>, then JSON call objects.

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "f", "parameters": {}}

The objects are separated by ";" (whitespace allowed); the arguments key is "parameters" or
"arguments". Only when the output, with leading whitespace and the tag removed, starts with "{" is
it tool calls; otherwise all of it (less the leading tag) is content. An object is listed as a call
once its name is read; an object that ends without a name -- ``{"answer": 42}`` -- is not a call:
it and the text after it are content. Text after the last call is content. A malformed object keeps
its call (complete=False, arguments as far as read) and the text from the offending character on is
content. The tag is a special token, hence needs_special_tokens.
"""
from __future__ import annotations

from twostep.entrypoints.openai.tool_parsers.base import ParsedOutput, ToolCallDraft, ToolParser
from twostep.entrypoints.openai.tool_parsers.content import join_content
from twostep.entrypoints.openai.tool_parsers.json_calls import scan_call_object
from twostep.entrypoints.openai.tool_parsers.json_scan import skip_ws

TAG = "<|python_tag|>"


def _parse_calls(text: str, pos: int) -> tuple[list[ToolCallDraft], int]:
    """The calls from the "{" at pos on, and where the content after them starts."""
    calls: list[ToolCallDraft] = []
    while True:
        obj = scan_call_object(text, pos)
        if obj.draft.name is None:
            return calls, (len(text) if obj.scan.is_open else pos)
        calls.append(obj.draft)
        if obj.scan.end is None:
            return calls, obj.scan.resume(len(text))
        after = skip_ws(text, obj.scan.end)
        if after < len(text) and text[after] == ";":
            pos = skip_ws(text, after + 1)
            if pos >= len(text):
                return calls, pos
            if text[pos] != "{":
                return calls, after
        else:
            return calls, after


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    needs_special_tokens = True

    def parse(self, text: str, final: bool) -> ParsedOutput:
        start = skip_ws(text, 0)
        tagged = text.startswith(TAG, start)
        if not tagged and not final and TAG.startswith(text[start:]):
            return ParsedOutput("", [])  # nothing yet, or the start of the tag
        untagged = text[:start] + text[start + len(TAG):] if tagged else text
        first = skip_ws(text, start + len(TAG)) if tagged else start
        if first >= len(text) or text[first] != "{":
            return ParsedOutput(join_content([untagged], final), [])
        calls, rest = _parse_calls(text, first)
        return ParsedOutput(join_content(["", text[rest:]], final), calls)
