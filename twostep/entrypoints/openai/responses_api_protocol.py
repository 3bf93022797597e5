"""OpenAI's Responses API (POST /v1/responses) as pydantic models: the request body, its input items
and the response object the server answers with.

As in protocol.py, the request's top level ignores fields this server does not know (named in the
`x-ignored-fields` header), nested objects are strict, and what would change the result but is not
implemented is refused with a 400 naming it: hosted tools (web_search, file_search, ...), image,
file and audio inputs, `background`, `conversation`, `prompt` templates, `include` (but
reasoning.encrypted_content: reasoning items carry their text, which can be sent back as is),
`top_logprobs`, `max_tool_calls` and `truncation: "auto"`.

A response's output items are valid input items, so a stored response continues as its
conversation: its input followed by its output.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, TypeAdapter, ValidationError, field_validator

_ITEM_STATUS = Literal["in_progress", "completed", "incomplete"]
_ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
_TEXT_PARTS = ("input_text", "output_text", "refusal")
_ENCRYPTED_REASONING = "reasoning.encrypted_content"
_MAX_METADATA = 16          # OpenAI's bounds on metadata: pairs, key and value lengths
_MAX_METADATA_KEY, _MAX_METADATA_VALUE = 64, 512


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


# ---- input items --------------------------------------------------------------------------------

class InputText(_Strict):
    type: Literal["input_text"]
    text: str


class OutputText(_Strict):
    type: Literal["output_text"]
    text: str
    annotations: list[dict[str, Any]] = Field(default_factory=list)
    logprobs: list[dict[str, Any]] | None = None


class Refusal(_Strict):
    type: Literal["refusal"]
    refusal: str


TextPart = Annotated[InputText | OutputText | Refusal, Field(discriminator="type")]


def part_text(part: InputText | OutputText | Refusal) -> str:
    return part.refusal if isinstance(part, Refusal) else part.text


class MessageItem(_Strict):
    """A message: the easy form ({role, content}) or an output message sent back."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextPart]
    id: str | None = None
    status: _ITEM_STATUS | None = None
    phase: Literal["commentary", "final_answer"] | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part_text(p) for p in self.content)


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str
    id: str | None = None
    status: _ITEM_STATUS | None = None


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[TextPart]
    id: str | None = None
    status: _ITEM_STATUS | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(part_text(p) for p in self.output)


class SummaryText(_Strict):
    type: Literal["summary_text"]
    text: str


class ReasoningText(_Strict):
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(_Strict):
    type: Literal["reasoning"]
    summary: list[SummaryText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    id: str | None = None
    status: _ITEM_STATUS | None = None
    encrypted_content: None = None      # never produced here, so none can come back

    def text(self) -> str:
        """The chain of thought (the summary where the text itself was not kept)."""
        parts = self.content or self.summary
        return "\n".join(p.text for p in parts)


def _item_type(value: Any) -> str:
    raw = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", "message")
    return raw if isinstance(raw, str) else "message"


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")] | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type)]
INPUT_ITEM: TypeAdapter = TypeAdapter(InputItem)


def _checked_items(value: Any) -> Any:
    """Each input item checked on its own, so that an error names the item and what is wrong with
    it (pydantic's own would name the string-or-list union's variants), and items and content parts
    of kinds this server cannot take are named."""
    if not isinstance(value, list):
        return value
    for i, item in enumerate(value):
        kind = _item_type(item) if isinstance(item, dict) else None
        if kind is not None and kind not in _ITEM_TYPES:
            raise ValueError(f"input[{i}]: items of type {kind!r} are not supported (supported: "
                             f"{', '.join(_ITEM_TYPES)})")
        parts = (item.get("content") if kind == "message" else item.get("output")) if kind else None
        for part in parts if isinstance(parts, list) else []:
            part_type = part.get("type") if isinstance(part, dict) else None
            if isinstance(part_type, str) and part_type not in _TEXT_PARTS:
                raise ValueError(f"input[{i}]: content parts of type {part_type!r} are not supported: only "
                                 "text (input_text, output_text) runs here")
        try:
            INPUT_ITEM.validate_python(item)
        except ValidationError as e:
            raise ValueError(f"input[{i}]{_where(e)}") from None
    return value


def _where(error: ValidationError) -> str:
    """An item's error, where it is and what: the deepest one (the union variant that got furthest),
    its path without the item's tag and the variants' type names."""
    err = max(error.errors(), key=lambda x: len(x["loc"]))
    path = [x for x in err["loc"][1:] if isinstance(x, int) or ("[" not in x and x not in ("str", "list"))]
    return "".join(f"[{x}]" if isinstance(x, int) else f".{x}" for x in path) + f": {err['msg']}"


# ---- tools, text format, reasoning --------------------------------------------------------------

class FunctionTool(_Strict):
    type: Literal["function"] = "function"
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None    # a JSON schema; none: no arguments
    strict: bool | None = None


class FunctionToolChoice(_Strict):
    type: Literal["function"]
    name: str


class TextFormatText(_Strict):
    type: Literal["text"]


class TextFormatJsonObject(_Strict):
    type: Literal["json_object"]


class TextFormatJsonSchema(_Strict):
    type: Literal["json_schema"]
    name: str = Field(min_length=1, max_length=64)
    json_schema: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None       # the schema is always enforced; strict also closes its objects


class TextConfig(_Strict):
    format: Annotated[TextFormatText | TextFormatJsonObject | TextFormatJsonSchema,
                      Field(discriminator="type")] = TextFormatText(type="text")


class ReasoningConfig(_Strict):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None   # summary's older name


# ---- the request ----------------------------------------------------------------------------------

class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    input: str | list[InputItem] | None = None
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["disabled", "auto"] | None = None
    include: list[str] | None = None
    # vLLM's extras, as in chat completions
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    structured_outputs: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # would change the result and are not implemented: refused, never dropped
    background: bool | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _text_items_only(cls, v):
        return _checked_items(v)

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools_only(cls, v):
        for i, tool in enumerate(v if isinstance(v, list) else []):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if isinstance(kind, str) and kind != "function":
                raise ValueError(f"tools[{i}]: tools of type {kind!r} are not supported: only function tools "
                                 '(type "function") run here')
        return v

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _function_choice_only(cls, v):
        kind = v.get("type") if isinstance(v, dict) else None
        if isinstance(kind, str) and kind != "function":
            raise ValueError(f"tool_choice of type {kind!r} is not supported: give none, auto, required or "
                             '{"type": "function", "name": ...}')
        return v

    @field_validator("metadata")
    @classmethod
    def _metadata_bounds(cls, v):
        if v is None:
            return v
        if len(v) > _MAX_METADATA:
            raise ValueError(f"metadata holds at most {_MAX_METADATA} pairs, got {len(v)}")
        for key, value in v.items():
            if len(key) > _MAX_METADATA_KEY or len(value) > _MAX_METADATA_VALUE:
                raise ValueError(f"metadata keys have at most {_MAX_METADATA_KEY} characters and values at "
                                 f"most {_MAX_METADATA_VALUE}")
        return v

    @field_validator("truncation")
    @classmethod
    def _no_auto_truncation(cls, v):
        if v == "auto":
            raise ValueError('truncation "auto" is not supported: a conversation too long for the context '
                             "is refused, never cut")
        return v

    @field_validator("include")
    @classmethod
    def _nothing_to_include(cls, v):
        odd = [x for x in v or [] if x != _ENCRYPTED_REASONING]
        if odd:
            raise ValueError(f"include {odd} is not supported (reasoning items carry their text in content; "
                             "nothing else can be included)")
        return v

    @field_validator("background")
    @classmethod
    def _no_background(cls, v):
        if v:
            raise ValueError("background responses are not supported: a response runs while its request waits")
        return v

    @field_validator("conversation", "prompt")
    @classmethod
    def _no_conversation_or_prompt(cls, v, info):
        if v is not None:
            hint = "use previous_response_id" if info.field_name == "conversation" else "send input and instructions"
            raise ValueError(f"{info.field_name} is not supported: {hint}")
        return v

    @field_validator("top_logprobs", "max_tool_calls")
    @classmethod
    def _not_implemented(cls, v, info):
        if v is not None and (v != 0 or info.field_name == "max_tool_calls"):
            raise ValueError(f"{info.field_name} is not supported")
        return v

    def ignored_fields(self) -> list[str]:
        """Fields of the request this server does not know (ignored, as vLLM does)."""
        return sorted(self.model_extra or {})

    def input_items(self) -> list:
        """The input as items: a string is one user message."""
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input or [])


# ---- the response -----------------------------------------------------------------------------------

class OutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: _ITEM_STATUS
    content: list[OutputText]


class OutputReasoning(BaseModel):
    id: str
    type: Literal["reasoning"] = "reasoning"
    summary: list[SummaryText]
    content: list[ReasoningText]
    status: _ITEM_STATUS


class OutputFunctionCall(BaseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: _ITEM_STATUS


OutputItem = Annotated[OutputMessage | OutputReasoning | OutputFunctionCall, Field(discriminator="type")]


class InputTokensDetails(BaseModel):
    cached_tokens: int
    cache_write_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseError(BaseModel):
    code: str
    message: str


class ResponseObject(BaseModel):
    """POST /v1/responses without stream (with stream: true its events), GET /v1/responses/{id}."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["completed", "incomplete", "failed", "in_progress"]
    incomplete_details: IncompleteDetails | None = None
    error: ResponseError | None = None
    model: str
    output: list[OutputItem]
    usage: ResponseUsage | None = None
    instructions: str | None = None
    tools: list[FunctionTool]
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice
    parallel_tool_calls: bool
    text: TextConfig
    reasoning: ReasoningConfig | None = None
    temperature: float | None = None
    top_p: float | None = None
    max_output_tokens: int | None = None
    previous_response_id: str | None = None
    store: bool
    metadata: dict[str, str]
    user: str | None = None
    truncation: Literal["disabled"] = "disabled"
    background: bool = False


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: bool
