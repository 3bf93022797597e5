"""Request bodies of the OpenAI API (plus vLLM's sampling extras), validated by pydantic.

A completions or chat request may carry fields this server does not know (OpenAI's SDKs send `store`,
`metadata`, `service_tier`, ...): as in vLLM they are ignored, and the server logs them and names them
in the response's `x-ignored-fields` header. Fields that would change the result and are not
implemented (beam search, legacy `functions`, audio) are refused with a 400 instead, so nothing that
matters is dropped silently. Nested objects stay strict (extra="forbid"). Types are strict: "16" is
not a number and "yes" not a boolean (an integer is a valid float).
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from twostep.sampling_params import SamplingParams, StructuredOutputsParams


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None      # the schema is always enforced; strict also closes its objects


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text, any JSON object, or JSON matching a schema."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def constraint(self) -> StructuredOutputsParams | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if self.json_schema is None:
            raise ValueError('response_format {"type": "json_schema"} needs "json_schema": '
                             '{"name": ..., "schema": {...}}')
        # strict: OpenAI's structured outputs close every object (no keys the schema does not name)
        return StructuredOutputsParams(json=self.json_schema.json_schema,
                                       disable_additional_properties=bool(self.json_schema.strict))


# vLLM's older names for structured outputs, and the field of StructuredOutputsParams each maps to.
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs, and its older names
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # vLLM's request extras
    request_id: str | None = Field(default=None, min_length=1, max_length=128)
    priority: int = 0
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)
    return_tokens_as_token_ids: bool = False
    prompt_logprobs: int | None = Field(default=None, ge=0)
    # prefill/decode disaggregation (vLLM's): {"do_remote_decode": true} to a prefill instance,
    # the parameters its answer carries to a decode instance
    kv_transfer_params: dict[str, Any] | None = None
    # would change the result and are not implemented: refused, never dropped
    use_beam_search: bool = False

    @field_validator("use_beam_search")
    @classmethod
    def _no_beam_search(cls, v):
        if v:
            raise ValueError("use_beam_search is not supported (twostep samples; no beam search)")
        return v

    def ignored_fields(self) -> list[str]:
        """Fields of the request this server does not know (ignored, as vLLM does)."""
        return sorted(self.model_extra or {})

    def truncate(self, ids: list[int]) -> list[int]:
        """truncate_prompt_tokens: only the prompt's last k tokens (vLLM's left truncation)."""
        k = self.truncate_prompt_tokens
        return ids[-k:] if k is not None and len(ids) > k else ids

    def constraint(self) -> StructuredOutputsParams | None:
        """The one structured-output constraint the request gives, under whichever name."""
        given: dict[str, StructuredOutputsParams] = {}
        if self.response_format is not None:
            c = self.response_format.constraint()
            if c is not None:
                given["response_format"] = c
        if self.structured_outputs is not None:
            given["structured_outputs"] = StructuredOutputsParams.from_dict(self.structured_outputs)
        for name, kind in GUIDED_FIELDS.items():
            value = getattr(self, name)
            if value is not None:
                given[name] = StructuredOutputsParams(**{kind: value})
        if len(given) > 1:
            raise ValueError(f"give one structured-output constraint, not several: {', '.join(given)}")
        return next(iter(given.values()), None)

    def token_bias(self) -> dict[int, float] | None:
        """logit_bias with its keys (token ids as JSON strings) as integers."""
        if not self.logit_bias:
            return None
        out = {}
        for key, bias in self.logit_bias.items():
            if not key.strip().lstrip("-").isdigit():
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
            out[int(key)] = bias
        return out

    def sampling_params(self, defaults: SamplingParams, max_tokens: int | None,
                        logprobs: int | None, prompt_logprobs: int | None = None,
                        constraint: StructuredOutputsParams | None = None) -> SamplingParams:
        """Unset fields fall back to the model's generation_config defaults, as in vLLM.
        constraint: one the server derived (a tool choice) instead of the request's own."""
        pick = lambda value, default: default if value is None else value  # noqa: E731
        return SamplingParams(
            n=self.n, temperature=pick(self.temperature, defaults.temperature),
            top_p=pick(self.top_p, defaults.top_p), top_k=pick(self.top_k, defaults.top_k),
            min_p=pick(self.min_p, defaults.min_p),
            repetition_penalty=pick(self.repetition_penalty, defaults.repetition_penalty),
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            seed=self.seed, max_tokens=max_tokens, min_tokens=self.min_tokens, stop=self.stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            structured_outputs=constraint or self.constraint(), logit_bias=self.token_bias(),
            allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words,
            extra_args=({"kv_transfer_params": self.kv_transfer_params}
                        if self.kv_transfer_params is not None else None),
        )


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    suffix: str | None = None
    max_tokens: int | None = 16
    logprobs: int | None = Field(default=None, ge=0)
    echo: bool = False
    best_of: int | None = None
    add_special_tokens: bool = True      # vLLM: BOS etc. as the tokenizer adds them

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v):
        if v is not None:
            raise ValueError("suffix is not supported (no fill-in-the-middle)")
        return v

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(t, int) for t in p):
            return [list(p)]
        return list(p)


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None    # a JSON schema; none: no arguments
    strict: bool | None = None


class ChatTool(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"] = "function"
    function: FunctionName


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0)
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's chat extras
    add_special_tokens: bool = False     # the template writes BOS etc. itself
    continue_final_message: bool = False  # the last (assistant) message stays open: the model continues it
    echo: bool = False                   # the reply starts with that last message when it is the assistant's
    documents: list[dict[str, Any]] | None = None   # for templates with a documents (RAG) section
    # OpenAI's legacy function calling and audio: not implemented
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None

    @field_validator("functions", "function_call")
    @classmethod
    def _no_legacy_functions(cls, v):
        if v is not None:
            raise ValueError("functions and function_call (OpenAI's legacy function calling) are not "
                             "supported: send tools and tool_choice")
        return v

    @field_validator("modalities")
    @classmethod
    def _text_only(cls, v):
        if v is not None and any(m != "text" for m in v):
            raise ValueError("only the text modality is supported")
        return v

    @field_validator("audio")
    @classmethod
    def _no_audio(cls, v):
        if v is not None:
            raise ValueError("audio output is not supported")
        return v


def messages_as_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as plain dicts; the tokenizer normalises them for the template (text content
    parts joined, tool-call arguments as objects) and raises ValueError on what it cannot take."""
    return [m.model_dump(exclude_none=True) for m in messages]


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    tokens: list[int]

