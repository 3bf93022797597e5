"""Tool-call parsers: reading the calls a model writes in its output, as vLLM's --tool-call-parser.

``TOOL_PARSERS`` maps the names --tool-call-parser accepts to their classes; ``get_tool_parser``
builds one by name. json_forms holds the parsers the server picks itself for tool_choice "required"
and a named function. See base for the parse contract and the streaming.
"""
from __future__ import annotations

from twostep.entrypoints.openai.tool_parsers.base import (ParsedOutput, StreamDelta, ToolCall, ToolCallDraft,
                                                          ToolCallStreamer, ToolParser, extract_tool_calls,
                                                          new_call_id)
from twostep.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from twostep.entrypoints.openai.tool_parsers.json_forms import NamedToolParser, RequiredToolsParser
from twostep.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from twostep.entrypoints.openai.tool_parsers.mistral import MistralToolParser
from twostep.entrypoints.openai.tool_parsers.pythonic import PythonicToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser
    for parser in (HermesToolParser, Llama3JsonToolParser, MistralToolParser, PythonicToolParser)
}


def get_tool_parser(name: str) -> ToolParser:
    """A new parser for a --tool-call-parser value; ValueError for an unknown one."""
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(sorted(TOOL_PARSERS))}")
    return TOOL_PARSERS[name]()


__all__ = [
    "TOOL_PARSERS", "HermesToolParser", "Llama3JsonToolParser", "MistralToolParser", "NamedToolParser",
    "ParsedOutput", "PythonicToolParser", "RequiredToolsParser", "StreamDelta", "ToolCall", "ToolCallDraft",
    "ToolCallStreamer", "ToolParser", "extract_tool_calls", "get_tool_parser", "new_call_id",
]
