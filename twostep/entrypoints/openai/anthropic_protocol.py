"""Anthropic's Messages API as pydantic models: the bodies of POST /v1/messages and
/v1/messages/count_tokens, and what they answer.

As protocol.py does for OpenAI's API, a request may carry top-level fields this server does not know
(ignored, logged and named in x-ignored-fields), while nested objects are strict, except for what
Anthropic's clients attach everywhere and that changes nothing here: `cache_control` (this server's
prefix cache needs no markers) and `citations` on text blocks sent back. Content blocks and tools of a
kind the server cannot run (images, documents, server tools such as web_search) parse, so that the
route can refuse them by name with a 400 rather than with a pydantic union error.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TextBlock(_Strict):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None
    citations: list[dict[str, Any]] | None = None


class ToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None
    caller: dict[str, Any] | None = None       # who made the call: always the model here
    toolset_name: str | None = None


class UnsupportedBlock(BaseModel):
    """A content block of a kind this server refuses (image, document, ...), by its type."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: str


def _by_block_type(known: tuple[str, ...]) -> Discriminator:
    """Blocks told apart by their type; one of another type is an UnsupportedBlock."""
    def kind(value: Any) -> str | None:
        block_type = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
        if not isinstance(block_type, str):
            return None
        return block_type if block_type in known else "unsupported"
    return Discriminator(kind, custom_error_type="block_type",
                         custom_error_message='a content block must be an object with a string "type"')


ToolResultPart = Annotated[
    Annotated[TextBlock, Tag("text")] | Annotated[UnsupportedBlock, Tag("unsupported")],
    _by_block_type(("text",))]


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[ToolResultPart] | None = None
    is_error: bool = False
    cache_control: dict[str, Any] | None = None
    toolset_name: str | None = None


class ThinkingBlock(_Strict):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Strict):
    type: Literal["redacted_thinking"]
    data: str


ContentBlock = Annotated[
    Annotated[TextBlock, Tag("text")] | Annotated[ToolUseBlock, Tag("tool_use")]
    | Annotated[ToolResultBlock, Tag("tool_result")] | Annotated[ThinkingBlock, Tag("thinking")]
    | Annotated[RedactedThinkingBlock, Tag("redacted_thinking")] | Annotated[UnsupportedBlock, Tag("unsupported")],
    _by_block_type(("text", "tool_use", "tool_result", "thinking", "redacted_thinking"))]


class InputMessage(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class CustomTool(_Strict):
    """A tool the client runs: its name, what it does and its arguments' JSON schema."""

    type: Literal["custom"] | None = None
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    input_schema: dict[str, Any]
    strict: bool | None = None          # arguments' objects closed: no keys the schema does not name
    cache_control: dict[str, Any] | None = None
    eager_input_streaming: bool | None = None   # arguments stream as they are written anyway


class ServerTool(BaseModel):
    """A tool Anthropic's servers run (web_search, code_execution, ...): refused by its type."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: str


def _tool_kind(value: Any) -> str:
    tool_type = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return "custom" if tool_type in (None, "custom") else "server"


Tool = Annotated[Annotated[CustomTool, Tag("custom")] | Annotated[ServerTool, Tag("server")],
                 Discriminator(_tool_kind)]


class ToolChoice(_Strict):
    """auto: the model decides; any: at least one call; tool: a call of the named tool; none: no call."""

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _name_with_tool(self):
        if (self.type == "tool") != (self.name is not None):
            raise ValueError('tool_choice needs "name" with type "tool", and only then')
        return self


class ThinkingConfig(_Strict):
    """enabled (or adaptive): the chat template may think, its reasoning returned as thinking blocks;
    disabled: the template is asked not to (enable_thinking: false). budget_tokens is accepted but
    max_tokens is what bounds thinking and answer together."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(default=None, ge=1)
    display: Literal["summarized"] | None = None     # the whole reasoning is returned; never "omitted"


class JsonOutputFormat(_Strict):
    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Strict):
    """Structured outputs: the answer is JSON valid for the schema. effort is a hint for Anthropic's
    models that a local model has no setting for."""

    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: JsonOutputFormat | None = None


class _Conversation(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    model: str
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    # would change the result and are not implemented: refused, never dropped
    mcp_servers: list[dict[str, Any]] | None = None

    @field_validator("mcp_servers")
    @classmethod
    def _no_mcp_servers(cls, v):
        if v:
            raise ValueError("mcp_servers is not supported: twostep runs client tools only")
        return v

    def ignored_fields(self) -> list[str]:
        """Top-level fields of the request this server does not know (ignored)."""
        return sorted(self.model_extra or {})


class MessagesRequest(_Conversation):
    """POST /v1/messages."""

    max_tokens: int
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None


class CountTokensRequest(_Conversation):
    """POST /v1/messages/count_tokens: the prompt a MessagesRequest with these fields would have."""


# ---- what the routes answer -----------------------------------------------------------------------


class TextContent(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ThinkingContent(BaseModel):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""       # nothing signs a local model's reasoning


class ToolUseContent(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: Any                # the arguments the model wrote, as parsed JSON


class OutputTokensDetails(BaseModel):
    thinking_tokens: int


class MessageUsage(BaseModel):
    """Anthropic's accounting: input_tokens are the prompt tokens computed for this request, the
    prefix cache's hit is cache_read_input_tokens (the prompt is their sum)."""

    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int = 0
    cache_creation_input_tokens: int = 0
    output_tokens_details: OutputTokensDetails | None = None    # with a reasoning parser


class MessageResponse(BaseModel):
    """POST /v1/messages without stream; with stream: true the body is Anthropic's server-sent events."""

    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ThinkingContent | TextContent | ToolUseContent]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use", "model_context_window_exceeded"] | None
    stop_sequence: str | None = None
    usage: MessageUsage


class CountTokensResponse(BaseModel):
    input_tokens: int


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    """Every error of the /v1/messages routes: Anthropic's shape."""

    type: Literal["error"] = "error"
    error: AnthropicErrorDetail
