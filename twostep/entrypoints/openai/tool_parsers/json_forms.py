"""Parsers for outputs that structured outputs already force into JSON.

The server uses them when the request's tool_choice is "required" (any number of calls, at least
one) or names one function.

RequiredToolsParser ("required"): the output is an array of calls,
``[{"name": "f", "parameters": {...}}, ...]``, read like the other JSON forms: a name once its string
is closed, the raw text of "parameters" (or "arguments") as it grows, complete once its object is
closed and valid. Output that is not an array is content, and so is the text from where the array
breaks or after it ends.

NamedToolParser ("named"): the whole output is the arguments object of the one function named, so
the call's name is known from the start (there is always exactly one call). The arguments are the
raw text from the first non-whitespace character; complete once they are one complete JSON value;
text after that value (or from where it breaks) is content.
"""
from __future__ import annotations

from twostep.entrypoints.openai.tool_parsers.base import ParsedOutput, ToolCallDraft, ToolParser
from twostep.entrypoints.openai.tool_parsers.content import join_content
from twostep.entrypoints.openai.tool_parsers.json_calls import scan_call_array
from twostep.entrypoints.openai.tool_parsers.json_scan import Scan, is_json, scan_value, skip_ws, value_prefix


class RequiredToolsParser(ToolParser):
    name = "required"
    needs_special_tokens = False

    def parse(self, text: str, final: bool) -> ParsedOutput:
        start = skip_ws(text, 0)
        if start >= len(text) or text[start] != "[":
            return ParsedOutput(join_content([text], final), [])
        array = scan_call_array(text, start)
        rest = text[array.scan.resume(len(text)):]
        return ParsedOutput(join_content(["", rest], final), array.drafts)


class NamedToolParser(ToolParser):
    name = "named"
    needs_special_tokens = False

    def __init__(self, function_name: str):
        self.function_name = function_name

    def parse(self, text: str, final: bool) -> ParsedOutput:
        start = skip_ws(text, 0)
        value = scan_value(text, start, final) if start < len(text) else Scan()
        arguments = value_prefix(text, start, value)
        complete = value.end is not None and is_json(arguments)
        rest = text[value.resume(len(text)):]
        call = ToolCallDraft(self.function_name, arguments, complete)
        return ParsedOutput(join_content(["", rest], final), [call])
