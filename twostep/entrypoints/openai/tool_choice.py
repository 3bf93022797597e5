"""What a chat request's tools and tool_choice mean for generation, as vLLM serves them:

- no tools, or tool_choice "none": plain content (tools, if any, still go to the template);
- "auto" (the default when tools are given): the model decides; the server's
  --tool-call-parser reads calls out of its text, so "auto" needs --enable-auto-tool-choice;
- "required": structured outputs force a JSON array of one or more calls
  ``[{"name": ..., "parameters": {...}}]``, each valid for its tool's parameter schema;
- a named function: structured outputs force that function's arguments object.

A tool with ``"strict": true`` (OpenAI's strict function calling) also gets its objects closed: no
argument keys its schema does not name.
"""
from __future__ import annotations

from dataclasses import dataclass

from twostep.entrypoints.openai.protocol import ChatCompletionRequest, ChatTool, NamedToolChoice
from twostep.entrypoints.openai.tool_parsers import (NamedToolParser, RequiredToolsParser, ToolParser,
                                                     get_tool_parser)
from twostep.sampling_params import StructuredOutputsParams

_NO_ARGUMENTS = {"type": "object", "properties": {}}


class ToolChoiceError(ValueError):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(slots=True)
class ToolPlan:
    parser: ToolParser | None = None                  # reads calls out of the output; None: content only
    constraint: StructuredOutputsParams | None = None  # forces the calls' JSON (required / named)
    max_calls: int | None = None                      # 1 with parallel_tool_calls false
    template_tools: list[dict] | None = None          # the tools as the chat template sees them
    calls_finish: bool = True                         # finish_reason "tool_calls" (a forced function: "stop")


def plan_tools(body: ChatCompletionRequest, auto_parser: str | None) -> ToolPlan:
    """auto_parser: the server's --tool-call-parser when --enable-auto-tool-choice is on."""
    tools, choice = body.tools or [], body.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise ToolChoiceError("tool_choice needs tools", "tool_choice")
        return ToolPlan()
    template_tools = [t.model_dump(exclude_none=True) for t in tools]
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise ToolChoiceError(f"tools have duplicate function names: {sorted(names)}", "tools")
    max_calls = None if body.parallel_tool_calls else 1
    if choice is None or choice == "auto":
        if auto_parser is None:
            raise ToolChoiceError('"auto" tool choice requires --enable-auto-tool-choice and '
                                  "--tool-call-parser to be set on the server", "tool_choice")
        return ToolPlan(get_tool_parser(auto_parser, template_tools), None, max_calls, template_tools)
    if choice == "none":
        return ToolPlan(None, None, None, template_tools)
    if _constrained(body):
        raise ToolChoiceError(f"tool_choice {_describe(choice)} cannot be combined with response_format "
                              "or structured_outputs", "tool_choice")
    if choice == "required":
        constraint = StructuredOutputsParams(json=required_schema(tools, max_calls),
                                             disable_additional_properties=all(t.function.strict for t in tools))
        return ToolPlan(RequiredToolsParser(), constraint, max_calls, template_tools)
    tool = next((t for t in tools if t.function.name == choice.function.name), None)
    if tool is None:
        raise ToolChoiceError(f"tool_choice names function {choice.function.name!r}, which is not in "
                              f"tools ({', '.join(names)})", "tool_choice")
    constraint = StructuredOutputsParams(json=_parameters(tool), disable_additional_properties=bool(tool.function.strict))
    return ToolPlan(NamedToolParser(tool.function.name), constraint, 1, template_tools, calls_finish=False)


def required_schema(tools: list[ChatTool], max_calls: int | None) -> dict:
    """One or more calls, each a tool's name with arguments valid for its parameters. Each tool's
    definitions ($defs, definitions) move to the top, renamed per tool, since its "#/$defs/..."
    references must still resolve once its schema sits inside the array."""
    calls, defs = [], {}
    for k, t in enumerate(tools):
        parameters, own = _hoisted(_parameters(t), f"tool{k}_")
        defs.update(own)
        calls.append({"type": "object",
                      "properties": {"name": {"const": t.function.name}, "parameters": parameters},
                      "required": ["name", "parameters"], "additionalProperties": False})
    schema = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if max_calls is not None:
        schema["maxItems"] = max_calls
    if defs:
        schema["$defs"] = defs
    return schema


def _hoisted(schema: dict, prefix: str) -> tuple[dict, dict]:
    """(the schema without its definitions, its definitions renamed with prefix), references
    rewritten to the new names."""
    own = {**schema.get("definitions", {}), **schema.get("$defs", {})}
    if not own:
        return schema, {}
    body = {k: v for k, v in schema.items() if k not in ("$defs", "definitions")}
    renamed = {f"{prefix}{name}": _with_refs(d, own, prefix) for name, d in own.items()}
    return _with_refs(body, own, prefix), renamed


def _with_refs(node, names: dict, prefix: str):
    if isinstance(node, list):
        return [_with_refs(n, names, prefix) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: _with_refs(v, names, prefix) for k, v in node.items()}
    ref = out.get("$ref")
    if isinstance(ref, str):
        for root in ("#/$defs/", "#/definitions/"):
            if ref.startswith(root) and ref[len(root):].split("/")[0] in names:
                out["$ref"] = "#/$defs/" + prefix + ref[len(root):]
    return out


def _parameters(tool: ChatTool) -> dict:
    return tool.function.parameters or _NO_ARGUMENTS


def _constrained(body: ChatCompletionRequest) -> bool:
    return (body.response_format is not None and body.response_format.type != "text") or any(
        getattr(body, f) is not None for f in
        ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar"))


def _describe(choice: str | NamedToolChoice) -> str:
    return repr(choice) if isinstance(choice, str) else f"function {choice.function.name!r}"
