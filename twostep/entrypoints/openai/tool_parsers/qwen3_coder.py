"""Qwen3-Coder's tool calls: XML-style tags with raw parameter values.

    I'll look that up.
    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

A value is the text between ``<parameter=NAME>`` and ``</parameter>`` less one leading and one
trailing newline, turned into JSON by the tool's parameter schema (see parameter_values: the
parser is built for each request with its tools). The arguments are the JSON object of the
parameters in the order written; they grow a parameter at a time, once its ``</parameter>`` is read,
and get their closing "}" when the function closes. A call's name is known at the ">" of
``<function=NAME>``.

Leniency, as vLLM's qwen3_coder parser: a ``<tool_call>`` block may hold several functions, and
text in it outside them is dropped; a ``<function=`` without ``<tool_call>`` is a call too (then a
``</tool_call>`` after it is skipped); a parameter without ``</parameter>`` ends where the next
parameter, the function or the block begins, and a function without ``</function>`` where the next
function or the block's end begins. At the end of the output whatever is open is closed: the
value being read counts (less a trailing start of its closing tag) and the call is complete. A
function whose name is not a name (it holds a "<") stays a call without a name, which is never
sent. Values are raw text, so a value that itself contains one of these tags is cut there.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from twostep.entrypoints.openai.tool_parsers.base import ParsedOutput, ToolCallDraft, ToolParser
from twostep.entrypoints.openai.tool_parsers.content import cut_partial_marker, join_content
from twostep.entrypoints.openai.tool_parsers.json_scan import skip_ws
from twostep.entrypoints.openai.tool_parsers.parameter_values import parameter_value

START, END = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"
_CALL_STARTS = (START, FUNCTION)
_VALUE_ENDS = (PARAMETER_END, PARAMETER, FUNCTION_END, END)
_BODY_MARKERS = (PARAMETER, FUNCTION_END, END, FUNCTION, START)


def _first(text: str, markers: tuple[str, ...], start: int) -> tuple[int, str | None]:
    """The earliest of markers in text[start:]: (position, marker), or (len(text), None)."""
    best, found = len(text), None
    for marker in markers:
        at = text.find(marker, start, best + len(marker))
        if at != -1 and (found is None or at < best):
            best, found = at, marker
    return best, found


def _cut_partial_markers(text: str, markers: tuple[str, ...]) -> str:
    """text without its longest suffix that is a proper prefix of one of markers."""
    return min((cut_partial_marker(text, marker) for marker in markers), key=len)


def _value_text(raw: str) -> str:
    """A parameter's text less the newline the format puts after its opening and before its closing tag."""
    raw = raw[1:] if raw.startswith("\n") else raw
    return raw[:-1] if raw.endswith("\n") else raw


@dataclass
class _Function:
    draft: ToolCallDraft
    end: int  # where the text after the function starts


class Qwen3CoderToolParser(ToolParser):
    name = "qwen3_coder"
    needs_special_tokens = False   # <tool_call> is an added token that is not special; the rest is text

    def __init__(self, tools: list[dict] | None = None):
        # function name -> its parameters' schemas ("properties"), for typing the raw values
        self._properties: dict[str, dict] = {}
        for tool in tools or []:
            function = tool.get("function") if isinstance(tool, dict) else None
            if isinstance(function, dict) and isinstance(function.get("name"), str):
                parameters = function.get("parameters")
                properties = parameters.get("properties") if isinstance(parameters, dict) else None
                self._properties[function["name"]] = properties if isinstance(properties, dict) else {}

    @classmethod
    def for_tools(cls, tools: list[dict]) -> Qwen3CoderToolParser:
        return cls(tools)

    def parse(self, text: str, final: bool) -> ParsedOutput:
        pieces: list[str] = []
        calls: list[ToolCallDraft] = []
        pos = 0
        while True:
            at, marker = _first(text, _CALL_STARTS, pos)
            if marker is None:
                break
            pieces.append(text[pos:at])
            if marker == START:
                pos = self._read_block(text, at + len(START), final, calls)
            else:
                pos = self._read_bare_function(text, at, final, calls)
        tail = text[pos:]
        pieces.append(tail if final else _cut_partial_markers(tail, _CALL_STARTS))
        return ParsedOutput(join_content(pieces, final), calls)

    def _read_block(self, text: str, pos: int, final: bool, calls: list[ToolCallDraft]) -> int:
        """Reads the functions of the block whose body starts at pos; returns where it ends."""
        while True:
            at, marker = _first(text, (FUNCTION, END), pos)
            if marker is None:
                return len(text)
            if marker == END:
                return at + len(END)
            function = self._read_function(text, at, final)
            calls.append(function.draft)
            pos = function.end

    def _read_bare_function(self, text: str, at: int, final: bool, calls: list[ToolCallDraft]) -> int:
        """A function written without <tool_call>; a </tool_call> after it is the block's end all the same."""
        function = self._read_function(text, at, final)
        calls.append(function.draft)
        after = skip_ws(text, function.end)
        if text.startswith(END, after):
            return after + len(END)
        if not final and END.startswith(text[after:]):
            return len(text)            # may still become </tool_call>: not content yet
        return function.end

    def _read_function(self, text: str, at: int, final: bool) -> _Function:
        """The call whose "<function=" is at text[at], and where the text after it starts."""
        name_start = at + len(FUNCTION)
        name_end = text.find(">", name_start)
        if name_end == -1:
            return _Function(ToolCallDraft(None, "", False), len(text))
        name = text[name_start:name_end].strip()
        if not name or "<" in name:
            end, marker = _first(text, (FUNCTION_END, END, FUNCTION, START), name_start)
            return _Function(ToolCallDraft(None, "", False), end + (len(marker) if marker == FUNCTION_END else 0))
        schemas = self._properties.get(name, {})
        members: list[str] = []
        pos, closed, end = name_end + 1, final, len(text)
        while True:
            at, marker = _first(text, _BODY_MARKERS, pos)
            if marker is None:
                break                    # open; at the end of the output, closed
            if marker != PARAMETER:
                closed, end = True, at + (len(marker) if marker == FUNCTION_END else 0)
                break
            key_start = at + len(PARAMETER)
            key_end = text.find(">", key_start)
            if key_end == -1:
                break                    # the parameter's name is still being written
            key = text[key_start:key_end].strip()
            if not key or "<" in key:    # not a parameter: skip its tag
                pos = key_start
                continue
            value_end, value_marker = _first(text, _VALUE_ENDS, key_end + 1)
            if value_marker is None:
                if final:                # the output ended in the value: it counts, as far as it got
                    raw = _cut_partial_markers(text[key_end + 1:], _VALUE_ENDS)
                    members.append(self._member(key, raw, schemas))
                break
            members.append(self._member(key, text[key_end + 1:value_end], schemas))
            pos = value_end + (len(PARAMETER_END) if value_marker == PARAMETER_END else 0)
        return _Function(ToolCallDraft(name, self._arguments(members, closed), closed), end)

    @staticmethod
    def _member(key: str, raw: str, schemas: dict) -> str:
        value = parameter_value(_value_text(raw), schemas.get(key))
        return f"{json.dumps(key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}"

    @staticmethod
    def _arguments(members: list[str], closed: bool) -> str:
        if not members and not closed:
            return ""
        return "{" + ", ".join(members) + ("}" if closed else "")
