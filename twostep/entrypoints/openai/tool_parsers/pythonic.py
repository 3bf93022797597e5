"""Pythonic tool calls (Llama 3.2, Llama 4): a Python list of calls with literal keyword arguments.

    [get_weather(city="Paris", days=3), get_time()]
    <|python_start|>[get_weather(city="Paris")]<|python_end|>

Only when the output, with leading whitespace and the optional <|python_start|> removed, starts
with "[" followed by ``name(`` (a dotted name) is it tool calls; otherwise all of it (less the
leading tag) is content, "[]" included. A call's name is known at its "("; each call is parsed with
``ast`` once its ")" is read, and its arguments appear whole then: the JSON (json.dumps) of its
keyword arguments, each read with ast.literal_eval (True/False/None become true/false/null, tuples
arrays). A call that does not parse that way (positional arguments, non-literal values) stays with
complete=False and arguments "". Text after the list (and after <|python_end|>) is content; so is
the text from where the list stops being a list of calls, once a call has been read.
"""
from __future__ import annotations

import ast
import json
import re

from twostep.entrypoints.openai.tool_parsers.base import ParsedOutput, ToolCallDraft, ToolParser
from twostep.entrypoints.openai.tool_parsers.content import join_content
from twostep.entrypoints.openai.tool_parsers.json_scan import scan_group, skip_ws

START = "<|python_start|>"
END = "<|python_end|>"
_NAME_CHARS = re.compile(r"[A-Za-z_][\w.]*")
_NAME = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")


def _literal_call(name: str, source: str) -> ToolCallDraft:
    """The call written in source, ``name(key=literal, ...)``."""
    incomplete = ToolCallDraft(name, "", False)
    try:
        node = ast.parse(source, mode="eval").body
    except (SyntaxError, ValueError):
        return incomplete
    if not isinstance(node, ast.Call) or node.args or any(kw.arg is None for kw in node.keywords):
        return incomplete
    try:
        kwargs = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
        return ToolCallDraft(name, json.dumps(kwargs, ensure_ascii=False, allow_nan=False), True)
    except (ValueError, TypeError, SyntaxError, RecursionError):
        return incomplete


def _after_list(text: str, pos: int, final: bool) -> str:
    """The content after the list's "]" at pos - 1: what follows an optional <|python_end|>."""
    start = skip_ws(text, pos)
    if text.startswith(END, start):
        return text[start + len(END):]
    if not final and END.startswith(text[start:]):
        return ""
    return text[pos:]


def _parse_list(text: str, pos: int, final: bool) -> tuple[list[ToolCallDraft], str | None]:
    """The calls of the list whose "[" is text[pos] and the content after them; content None when
    the text is not a list of calls (it stopped being one before any call was read)."""
    calls: list[ToolCallDraft] = []
    i = skip_ws(text, pos + 1)
    while True:
        if i >= len(text):
            return calls, ""
        if text[i] == "]":
            return (calls, _after_list(text, i + 1, final)) if calls else ([], None)
        chars = _NAME_CHARS.match(text, i)
        paren = skip_ws(text, chars.end()) if chars else i
        if chars and paren >= len(text) and not final:
            return calls, ""  # the name may go on
        if not chars or paren >= len(text) or text[paren] != "(" or not _NAME.fullmatch(chars.group()):
            return (calls, text[i:]) if calls else ([], None)
        group = scan_group(text, paren, python=True)
        if group.end is None:
            calls.append(ToolCallDraft(chars.group(), "", False))
            return calls, ("" if group.error is None else text[group.error:])
        calls.append(_literal_call(chars.group(), text[i:group.end]))
        i = skip_ws(text, group.end)
        if i < len(text) and text[i] == ",":
            i = skip_ws(text, i + 1)
        elif i < len(text) and text[i] != "]":
            return calls, text[i:]


class PythonicToolParser(ToolParser):
    name = "pythonic"
    needs_special_tokens = False

    def parse(self, text: str, final: bool) -> ParsedOutput:
        start = skip_ws(text, 0)
        tagged = text.startswith(START, start)
        if not tagged and not final and START.startswith(text[start:]):
            return ParsedOutput("", [])  # nothing yet, or the start of the tag
        untagged = text[:start] + text[start + len(START):] if tagged else text
        first = skip_ws(text, start + len(START)) if tagged else start
        if first < len(text) and text[first] == "[":
            calls, rest = _parse_list(text, first, final)
            if rest is not None and (calls or not final):
                return ParsedOutput(join_content(["", rest], final), calls)
        return ParsedOutput(join_content([untagged], final), [])
