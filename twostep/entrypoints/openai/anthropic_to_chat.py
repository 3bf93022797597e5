"""An Anthropic Messages request as the chat request the chat core runs (chat.py's run_chat).

- system (a string or text blocks) becomes the first message, role system;
- a user message's tool_result blocks become tool messages (tool_call_id: the tool_use_id), in
  their place among its text; a failed call's result (is_error) is marked "Error: " for the model;
- an assistant message's tool_use blocks become its tool_calls, its thinking blocks its reasoning
  (the templates that write reasoning back read it); redacted_thinking carries only an opaque
  blob of Anthropic's and nothing a local template could use, so it is left out;
- the text blocks of one message are joined with newlines;
- a conversation that ends with an assistant message asks for its continuation (Anthropic's
  prefill): the template leaves that message open and the reply holds only the new text;
- tool_choice any is chat's "required", tool a named function, disable_parallel_tool_use
  parallel_tool_calls false; thinking disabled asks the template for no thinking
  (enable_thinking: false), enabled for thinking;
- output_config.format (structured outputs) is chat's response_format json_schema.
Blocks and tools the server cannot run (images, documents, server tools) are refused by name.
"""
from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from twostep.entrypoints.openai.anthropic_protocol import (CountTokensRequest, CustomTool, InputMessage,
                                                          MessagesRequest, RedactedThinkingBlock, TextBlock,
                                                          ThinkingBlock, ToolChoice, ToolResultBlock, ToolUseBlock)
from twostep.entrypoints.openai.errors import APIError
from twostep.entrypoints.openai.protocol import ChatCompletionRequest


def chat_request(body: MessagesRequest | CountTokensRequest) -> ChatCompletionRequest:
    """The chat request with the same prompt (and, for a MessagesRequest, the same sampling)."""
    prefill = body.messages[-1].role == "assistant"
    fields: dict[str, Any] = {
        "model": body.model, "messages": _system(body.system) + _conversation(body.messages),
        "add_generation_prompt": not prefill, "continue_final_message": prefill}
    if body.tools:
        fields["tools"] = _tools(body.tools)
    if body.tool_choice is not None:
        fields.update(_tool_choice(body.tool_choice))
    if body.thinking is not None:
        fields["chat_template_kwargs"] = {"enable_thinking": body.thinking.type != "disabled"}
    if isinstance(body, MessagesRequest):
        fields.update(_sampling(body))
        if body.output_config is not None and body.output_config.format is not None:
            fields["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "output", "schema": body.output_config.format.json_schema}}
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as e:     # what the chat API is stricter about than Anthropic's (a long tool name)
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"])
        raise APIError(400, f"{where}: {err['msg']}", where) from None


def _sampling(body: MessagesRequest) -> dict[str, Any]:
    fields: dict[str, Any] = {"max_tokens": body.max_tokens, "stream": body.stream}
    if body.stream:
        fields["stream_options"] = {"include_usage": True}
    if body.stop_sequences:
        fields["stop"] = body.stop_sequences
    for name in ("temperature", "top_p", "top_k"):
        if getattr(body, name) is not None:
            fields[name] = getattr(body, name)
    return fields


def _system(system: str | list[TextBlock] | None) -> list[dict]:
    text = system if isinstance(system, str) or system is None else "\n".join(b.text for b in system)
    return [{"role": "system", "content": text}] if text else []


def _conversation(messages: list[InputMessage]) -> list[dict]:
    out: list[dict] = []
    for i, message in enumerate(messages):
        if isinstance(message.content, str):
            out.append({"role": message.role, "content": message.content})
        elif message.role == "user":
            out.extend(_user_turn(message.content, f"messages.{i}.content"))
        else:
            out.append(_assistant_turn(message.content, f"messages.{i}.content"))
    return out


def _user_turn(blocks: list, where: str) -> list[dict]:
    """Text and tool results in their order: text before a result is a user message of its own."""
    out: list[dict] = []
    texts: list[str] = []
    for j, block in enumerate(blocks):
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ToolResultBlock):
            if texts:
                out.append({"role": "user", "content": "\n".join(texts)})
                texts = []
            out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                        "content": _tool_result_text(block, f"{where}.{j}.content")})
        else:
            raise _refused(block, f"{where}.{j}", "user")
    if texts or not out:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _tool_result_text(block: ToolResultBlock, where: str) -> str:
    content = block.content
    if content is None or isinstance(content, str):
        text = content or ""
    else:
        bad = next((k for k, part in enumerate(content) if not isinstance(part, TextBlock)), None)
        if bad is not None:
            raise _refused(content[bad], f"{where}.{bad}", "tool_result")
        text = "\n".join(part.text for part in content)
    return f"Error: {text}" if block.is_error else text


def _assistant_turn(blocks: list, where: str) -> dict:
    texts: list[str] = []
    calls: list[dict] = []
    thoughts: list[str] = []
    for j, block in enumerate(blocks):
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ToolUseBlock):
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}})
        elif isinstance(block, ThinkingBlock):
            thoughts.append(block.thinking)
        elif not isinstance(block, RedactedThinkingBlock):
            raise _refused(block, f"{where}.{j}", "assistant")
    message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts) if texts or not calls else None}
    if calls:
        message["tool_calls"] = calls
    if thoughts:
        message["reasoning"] = "\n".join(thoughts)
    return message


def _refused(block, where: str, holder: str) -> APIError:
    kind = block.type
    if kind in ("tool_use", "thinking", "redacted_thinking"):
        return APIError(400, f"{where}: a {holder} message cannot hold {kind} blocks (only the assistant's can)", where)
    if kind == "tool_result":
        return APIError(400, f"{where}: a {holder} message cannot hold tool_result blocks (only the user's can)", where)
    return APIError(400, f"{where}: content blocks of type {kind!r} are not supported: twostep runs a model's text "
                         "(text, tool_use, tool_result and thinking blocks)", where)


def _tools(tools: list) -> list[dict]:
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, CustomTool):
            raise APIError(400, f"tools.{i}: server tools (type {tool.type!r}) are not supported: twostep runs "
                                "client tools ({name, description, input_schema})", f"tools.{i}")
        function = {"name": tool.name, "description": tool.description, "parameters": tool.input_schema,
                    "strict": tool.strict}
        out.append({"type": "function", "function": {k: v for k, v in function.items() if v is not None}})
    return out


def _tool_choice(choice: ToolChoice) -> dict[str, Any]:
    fields: dict[str, Any] = {"tool_choice": {"auto": "auto", "any": "required", "none": "none"}.get(choice.type)
                              or {"type": "function", "function": {"name": choice.name}}}
    if choice.disable_parallel_tool_use:
        fields["parallel_tool_calls"] = False
    return fields
