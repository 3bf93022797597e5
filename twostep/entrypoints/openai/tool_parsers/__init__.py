"""Tool-call parsers: reading the calls a model writes in its output, as vLLM's --tool-call-parser.

``TOOL_PARSERS`` maps the names --tool-call-parser accepts to their classes; ``get_tool_parser``
builds one by name. json_forms holds the parsers the server picks itself for tool_choice "required"
and a named function. See base for the parse contract and the streaming.
"""
from __future__ import annotations

from twostep.entrypoints.openai.tool_parsers.base import (ParsedOutput, StreamDelta, ToolCall, ToolCallDraft,
                                                          ToolCallStreamer, ToolParser, extract_tool_calls,
                                                          new_call_id)
from twostep.entrypoints.openai.tool_parsers.gpt_oss import GptOssToolParser
from twostep.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from twostep.entrypoints.openai.tool_parsers.json_forms import NamedToolParser, RequiredToolsParser
from twostep.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from twostep.entrypoints.openai.tool_parsers.mistral import MistralToolParser
from twostep.entrypoints.openai.tool_parsers.pythonic import PythonicToolParser
from twostep.entrypoints.openai.tool_parsers.qwen3_coder import Qwen3CoderToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser
    for parser in (GptOssToolParser, HermesToolParser, Llama3JsonToolParser, MistralToolParser,
                   PythonicToolParser, Qwen3CoderToolParser)
}


def get_tool_parser(name: str, tools: list[dict] | None = None) -> ToolParser:
    """A new parser for a --tool-call-parser value, for a request with these tools (OpenAI function
    tools; see ToolParser.for_tools); ValueError for an unknown name."""
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(sorted(TOOL_PARSERS))}")
    return TOOL_PARSERS[name].for_tools(tools or [])


__all__ = [
    "TOOL_PARSERS", "GptOssToolParser", "HermesToolParser", "Llama3JsonToolParser", "MistralToolParser",
    "NamedToolParser", "ParsedOutput", "PythonicToolParser", "Qwen3CoderToolParser", "RequiredToolsParser",
    "StreamDelta", "ToolCall", "ToolCallDraft", "ToolCallStreamer", "ToolParser", "extract_tool_calls",
    "get_tool_parser", "new_call_id",
]
