"""What the server answers, as pydantic models: they make the OpenAPI schema say what each route
really returns (the handlers build the same shapes), and schemathesis holds the server to them."""
from __future__ import annotations

from pydantic import BaseModel


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    """Every error: OpenAI's shape."""

    error: ErrorDetail


class ModelCard(BaseModel):
    id: str
    object: str = "model"
    created: int
    owned_by: str
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: str = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    prompt: str


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None   # with a reasoning parser


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(BaseModel):
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None   # with prompt_logprobs (vLLM)


class CompletionResponse(BaseModel):
    """POST /v1/completions without stream; with stream: true the body is server-sent events."""

    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class FunctionCall(BaseModel):
    name: str
    arguments: str      # JSON text


class ToolCall(BaseModel):
    id: str
    type: str = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: str
    content: str | None
    reasoning: str | None = None            # with a reasoning parser: the chain of thought
    reasoning_content: str | None = None    # the same, under its older name
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    """POST /v1/chat/completions without stream; with stream: true the body is server-sent events."""

    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None   # with prompt_logprobs (vLLM)


class VersionResponse(BaseModel):
    version: str


class TokenizerInfoResponse(BaseModel):
    """GET /tokenizer_info (with --enable-tokenizer-info-endpoint), as vLLM answers it."""

    tokenizer_class: str
    chat_template: str | None = None
    model_max_length: int
    vocab_size: int
    add_bos_token: bool
    bos_token: str | None = None
    eos_token: str | None = None
    pad_token: str | None = None
    unk_token: str | None = None
