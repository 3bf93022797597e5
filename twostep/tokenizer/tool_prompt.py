"""Tools for chat templates that have no tool section (SmolLM2's, for one): the documented fallback.

A template that never reads the ``tools`` variable would drop the tools silently. Instead the tools
are stated in the system message, with the instruction to call them in the Hermes format
(``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, what ``--tool-call-parser hermes``
reads); an assistant's earlier calls are written back in that format, and tool results become
``<tool_response>`` user turns, since such templates know no "tool" role.
"""
from __future__ import annotations

import json
from functools import lru_cache

TOOLS_PREAMBLE = (
    "You may call one or more functions to assist with the user query. The functions are described "
    "in JSON Schema here:\n<tools>\n{tools}\n</tools>\n\nTo call a function, reply with a JSON object "
    "holding its name and arguments inside <tool_call></tool_call> tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>')


@lru_cache(maxsize=32)
def template_reads_tools(template_text: str) -> bool:
    """Whether a chat template uses the ``tools`` variable at all."""
    import jinja2
    import jinja2.meta

    try:
        names = jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(template_text))
    except jinja2.TemplateSyntaxError:
        return "tools" in template_text
    return "tools" in names


def messages_with_tools(messages: list[dict], tools: list[dict]) -> list[dict]:
    """The conversation with the tools in its system message, calls and results as text."""
    preamble = TOOLS_PREAMBLE.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
    out = [_as_text(m) for m in messages]
    if out and out[0].get("role") == "system":
        out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{preamble}".lstrip()}
    else:
        out.insert(0, {"role": "system", "content": preamble})
    return out


def _as_text(message: dict) -> dict:
    if message.get("role") == "tool":
        return {"role": "user", "content": f"<tool_response>\n{message.get('content') or ''}\n</tool_response>"}
    calls = message.get("tool_calls")
    if message.get("role") != "assistant" or not calls:
        return message
    blocks = [message["content"]] if message.get("content") else []
    for call in calls:
        function = call.get("function", call)
        blocks.append("<tool_call>\n" + json.dumps({"name": function.get("name"),
                                                    "arguments": function.get("arguments", {})},
                                                   ensure_ascii=False) + "\n</tool_call>")
    rest = {k: v for k, v in message.items() if k != "tool_calls"}
    return {**rest, "content": "\n".join(blocks)}
