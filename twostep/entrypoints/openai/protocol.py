"""Request bodies of the OpenAI API (plus vLLM's sampling extras), validated by pydantic.

Unknown fields are refused (extra="forbid"), as OpenAI does. Fields OpenAI defines that we
do not implement are accepted only at their neutral value, so a client never gets silently
different behaviour. Types are strict: "16" is not a number and "yes" not a boolean (an integer
is a valid float).
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from twostep.sampling_params import SamplingParams


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

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

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, v):
        if v:
            raise ValueError("logit_bias is not supported")
        return v

    def sampling_params(self, defaults: SamplingParams, max_tokens: int | None,
                        logprobs: int | None, prompt_logprobs: int | None = None) -> SamplingParams:
        """Unset fields fall back to the model's generation_config defaults, as in vLLM."""
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
        )


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    suffix: str | None = None
    max_tokens: int | None = 16
    logprobs: int | None = Field(default=None, ge=0)
    echo: bool = False
    best_of: int | None = None

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
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, v):
        if v is not None and v.get("type", "text") != "text":
            raise ValueError("only response_format {'type': 'text'} is supported")
        return v

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, v):
        if v:
            raise ValueError("tools are not supported")
        return v



def messages_as_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as the chat template reads them: text content parts joined into one string."""
    out = []
    for m in messages:
        d = m.model_dump(exclude_none=True)
        if isinstance(d.get("content"), list):   # [{"type": "text", "text": ...}, ...]
            parts = d["content"]
            if any(p.get("type") != "text" for p in parts):
                raise ValueError("only text content parts are supported")
            d["content"] = "".join(p.get("text", "") for p in parts)
        out.append(d)
    return out


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    tokens: list[int]

