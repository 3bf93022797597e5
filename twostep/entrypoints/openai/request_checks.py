"""What a completion or chat request is checked against before it reaches the engine: the model's
name, max_model_len, the queue's bound on prompts x n, logprobs, chat template kwargs; and the
prompt's and messages' token ids, encoded off the event loop.
"""
from __future__ import annotations

import asyncio

from twostep.entrypoints.openai.errors import APIError
from twostep.entrypoints.openai.protocol import ChatCompletionRequest, messages_as_dicts
from twostep.entrypoints.openai.state import ServerState
from twostep.sampling_params import SamplingParams, StructuredOutputsParams

# chat_template_kwargs a request may set: plain values the template reads; never the template itself
# (or tools) unless the server trusts requests' templates
_TEMPLATE_SOURCES = ("chat_template", "tools", "documents")


def check_generates(state: ServerState) -> None:
    """A pooling server (--runner pooling) makes vectors: every route that generates answers 400."""
    if state.engine.engine.pooling is not None:
        raise APIError(400, "this server runs a pooling model (--runner pooling): it serves /v1/embeddings, "
                            "/v1/score and /v1/rerank, not generation; start `twostep serve MODEL --runner generate` "
                            "with a causal LM for completions and chat", "model")


def check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.model_name and model not in state.config.model_aliases:
        raise APIError(404, f"the model {model!r} does not exist; this server serves "
                            f"{state.model_name!r}", "model")


def check_prompt_logprobs(state: ServerState, body) -> None:
    if body.prompt_logprobs is not None and body.stream:
        raise APIError(400, "prompt_logprobs is not supported with stream: true", "prompt_logprobs")
    check_logprobs(state, "prompt_logprobs", body.prompt_logprobs)


async def compile_constraint(state: ServerState, params: SamplingParams) -> None:
    """Compile the request's grammar in a worker thread (cached: the engine's own compile of it is
    then a lookup), so a long compile never holds up the engine's steps; a bad one is a 400."""
    so = params.structured_outputs
    if so is None:
        return
    try:
        await asyncio.to_thread(state.engine.engine.grammar_compiler.grammar, so)
    except ValueError as e:
        raise APIError(400, str(e), "structured_outputs") from None


def check_logprobs(state: ServerState, field: str, value: int | None) -> None:
    limit = state.engine.engine.config.max_logprobs
    if value is not None and value > limit:
        raise APIError(400, f"{field} must be <= {limit} (the server's --max-logprobs), got {value}", field)


async def encode_messages(state: ServerState, messages, add_generation_prompt: bool,
                       template_kwargs: dict | None = None, tools: list[dict] | None = None,
                       body: ChatCompletionRequest | None = None) -> list[int]:
    """Messages through the chat template, rendered in a worker thread (a template is code: the event
    loop never runs it); what is wrong with them (empty, non-text parts, a template that raises) is
    a 400 naming messages."""
    if not messages:
        raise APIError(400, "messages is empty: give at least one message", "messages")
    kwargs = _template_kwargs(state, template_kwargs)
    if state.config.chat_template is not None:
        kwargs.setdefault("chat_template", state.config.chat_template)
    if tools:
        kwargs["tools"] = tools
    special = False
    if body is not None:
        special = body.add_special_tokens
        if body.continue_final_message:
            kwargs["continue_final_message"] = True
        if body.documents is not None:
            kwargs["documents"] = body.documents
    try:
        return await asyncio.to_thread(state.tokenizer.encode_chat, messages_as_dicts(messages),
                                       add_generation_prompt, special, **kwargs)
    except ValueError as e:
        raise APIError(400, str(e), "messages") from None
    except Exception as e:  # a template that raises on these messages (raise_exception)
        raise APIError(400, f"the chat template rejected the messages: {e}", "messages") from None


def _template_kwargs(state: ServerState, kwargs: dict | None) -> dict:
    """chat_template_kwargs as the template may read them: plain values only, and never a template
    (unless the server trusts its clients' templates) nor tools."""
    out = dict(kwargs or {})
    for key, value in out.items():
        if key in _TEMPLATE_SOURCES and not (key == "chat_template" and state.config.trust_request_chat_template):
            hint = " (start the server with --trust-request-chat-template)" if key == "chat_template" else ""
            raise APIError(400, f"chat_template_kwargs.{key} is not accepted{hint}", "chat_template_kwargs")
        if key != "chat_template" and not isinstance(value, (str, int, float, bool, type(None))):
            raise APIError(400, f"chat_template_kwargs.{key} must be a string, number, boolean or null",
                           "chat_template_kwargs")
    return out


async def encode_prompts(state: ServerState, prompts: list[str | list[int]],
                      add_special_tokens: bool = True) -> list[list[int]]:
    """Every prompt as token ids, tokenized in a worker thread. A text too long to fit in
    max_model_len tokens whatever it says is refused by its length alone, before any work."""
    for p in prompts:
        if not p:
            raise APIError(400, "prompt is empty: give at least one character or token", "prompt")
        if isinstance(p, str):
            check_characters(state, len(p), "prompt")
    tok = state.tokenizer
    texts = [p for p in prompts if isinstance(p, str)]
    encoded = iter(await asyncio.to_thread(tok.encode_batch, texts, add_special_tokens) if texts else [])
    return [next(encoded) if isinstance(p, str) else list(p) for p in prompts]


def check_characters(state: ServerState, num_chars: int, field: str) -> None:
    """A text too long for max_model_len tokens whatever it says, known by its length alone."""
    tok, limit = state.tokenizer, state.engine.engine.max_model_len
    if num_chars > (limit - 1) * tok.max_token_chars:
        raise APIError(400, f"the {field} has {num_chars:,} characters: more than max_model_len {limit} "
                            "tokens of this tokenizer can spell", field)


def check_fan_out(state: ServerState, num_prompts: int, n: int) -> None:
    """One request may not queue more sequences (prompts x n) than the whole queue holds."""
    limit = state.config.max_queued_requests
    if num_prompts * n > limit:
        raise APIError(400, f"this request asks for {num_prompts * n} sequences ({num_prompts} prompts x "
                            f"n {n}); the server queues at most {limit} (--max-queued-requests)", "n")


def check_length(state: ServerState, ids: list[int], max_tokens: int | None, field: str,
                  default_note: str = "") -> None:
    """vLLM's rule: the prompt and max_tokens together must fit max_model_len."""
    limit = state.engine.engine.max_model_len
    if len(ids) >= limit:
        raise APIError(400, f"the {field} has {len(ids)} tokens; max_model_len is {limit}, which must "
                            "leave room for at least one generated token", field)
    if max_tokens is not None and len(ids) + max_tokens > limit:
        raise APIError(400, f"this request has {len(ids)} prompt tokens and max_tokens {max_tokens}"
                            f"{default_note}: {len(ids) + max_tokens} is over max_model_len {limit}; "
                            f"shorten the {field} or lower max_tokens", "max_tokens")


def request_params(state: ServerState, body, max_tokens, logprobs, prompt_logprobs,
            constraint: StructuredOutputsParams | None = None) -> SamplingParams:
    check_generates(state)
    try:
        return body.sampling_params(state.engine.engine.default_sampling_params(), max_tokens,
                                    logprobs, prompt_logprobs, constraint)
    except ValueError as e:
        raise APIError(400, str(e), str(e).split(" ")[0].split(".")[0]) from None
