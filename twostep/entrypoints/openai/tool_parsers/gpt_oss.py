"""gpt-oss's tool calls: harmony messages addressed to a function (see entrypoints/harmony.py).

    <|channel|>analysis<|message|>Need the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather json<|message|>{"city": "Paris"}<|call|>

The parser reads the *raw* output, special tokens kept (reads_harmony: the chat route gives it the
whole text, not the answer). Every assistant message whose recipient is ``functions.NAME`` is a
call, in order: its name is NAME, known once the header is read (the recipient may stand before or
after the channel; the commentary channel is the usual one, and a call on another channel is
taken too, as gpt-oss sometimes writes one on analysis); its arguments are the message's text as
it grows, complete once the message is closed (or the output ends) and the text is valid JSON. The
content is the answer: the final channel's text (several final messages joined with a newline),
or the output itself when it is not harmony at all. Analysis and commentary without a function
recipient are neither: they are reasoning and preambles, which the chat route reads apart;
messages to other recipients (built-in tools such as ``browser.search``) are left out.
"""
from __future__ import annotations

from twostep.entrypoints.harmony import HarmonyMessage, HarmonyParser, answer_part
from twostep.entrypoints.openai.tool_parsers.base import ParsedOutput, ToolCallDraft, ToolParser
from twostep.entrypoints.openai.tool_parsers.json_scan import is_json

FUNCTIONS = "functions."


def _is_call(message: HarmonyMessage) -> bool:
    return message.role == "assistant" and (message.recipient or "").startswith(FUNCTIONS)


def _call(message: HarmonyMessage, final: bool) -> ToolCallDraft:
    name = message.recipient[len(FUNCTIONS):] or None
    complete = name is not None and (message.closed or final) and is_json(message.content)
    return ToolCallDraft(name, message.content, complete)


class GptOssToolParser(ToolParser):
    name = "gpt_oss"
    needs_special_tokens = True    # the messages are told apart by harmony's special tokens
    reads_harmony = True

    def parse(self, text: str, final: bool) -> ParsedOutput:
        reader = HarmonyParser()
        reader.feed(text)
        if final:
            reader.finish()
        answer: list[str] = []
        calls: list[ToolCallDraft] = []
        for message in reader.messages:
            if _is_call(message):
                calls.append(_call(message, final))
            elif answer_part(message) == "content" and message.content:
                answer.append(message.content)
        return ParsedOutput("\n".join(answer), calls)
