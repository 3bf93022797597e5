"""POST /v1/chat/completions: messages through the chat template, tool calls planned and parsed,
structured outputs, logprobs, streamed or not.

A model that speaks harmony (gpt-oss; the rule is in entrypoints/harmony.py) generates with its
special tokens kept in the text and stops at <|return|> and <|call|>; the answer (its final channel)
is the content and its chain of thought (the analysis channel) goes to reasoning_content and
reasoning, never to content. Tool calls are then read out of the answer.
"""
from __future__ import annotations

from fastapi import Request

from twostep.entrypoints.harmony import HarmonyChat, is_harmony_tokenizer, parse_chat_output, turn_end_token_ids
from twostep.entrypoints.openai import serving
from twostep.entrypoints.openai.errors import APIError
from twostep.entrypoints.openai.fan_out import Batch, collect, with_transfer
from twostep.entrypoints.openai.protocol import ChatCompletionRequest
from twostep.entrypoints.openai.request_checks import (
    check_characters,
    check_fan_out,
    check_length,
    check_logprobs,
    check_model,
    check_prompt_logprobs,
    compile_constraint,
    encode_messages,
    request_params,
)
from twostep.entrypoints.openai.serving import Choice
from twostep.entrypoints.openai.sse import sse_response
from twostep.entrypoints.openai.state import ServerState
from twostep.entrypoints.openai.tool_choice import ToolChoiceError, ToolPlan, plan_tools
from twostep.entrypoints.openai.tool_parsers import StreamDelta, ToolCallStreamer, extract_tool_calls


async def create_chat_completion(state: ServerState, body: ChatCompletionRequest, raw: Request):
    result = await run_chat(state, body, raw)
    return sse_response(result) if body.stream else result


async def run_chat(state: ServerState, body: ChatCompletionRequest, raw: Request):
    """A chat request checked, queued and run: the chat.completion body, or with stream: true an
    async iterator of its chat.completion.chunk bodies. The other APIs that chat (Responses,
    Anthropic Messages) translate their requests into a ChatCompletionRequest and these results
    back into their own shapes; a bad request raises APIError before anything is queued."""
    check_model(state, body.model)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if max_tokens is not None and max_tokens < 1:
        raise APIError(400, f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
    top = body.top_logprobs or 0
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    check_logprobs(state, "top_logprobs", top)
    check_fan_out(state, 1, body.n)
    check_characters(state, sum(len(m.content) if isinstance(m.content, str) else
                                 sum(len(str(p.get("text", ""))) for p in m.content or [])
                                 for m in body.messages), "messages")
    try:
        plan = plan_tools(body, state.config.auto_tool_parser)
    except ToolChoiceError as e:
        raise APIError(400, str(e), e.param) from None
    check_prompt_logprobs(state, body)
    ids = body.truncate(await encode_messages(state, body.messages, body.add_generation_prompt,
                                           body.chat_template_kwargs, plan.template_tools, body))
    check_length(state, ids, max_tokens, "messages")
    params = request_params(state, body, max_tokens, top if body.logprobs else None, body.prompt_logprobs,
                     plan.constraint)
    if plan.parser is not None and plan.parser.needs_special_tokens:
        params.skip_special_tokens = False       # the call markup is a special token
    harmony = is_harmony_tokenizer(state.tokenizer)
    if harmony:
        params.skip_special_tokens = False       # the channels are told apart by special tokens
        params.stop_token_ids = list(dict.fromkeys(params.stop_token_ids + turn_end_token_ids(state.tokenizer)))
    await compile_constraint(state, params)
    batch = Batch(state, "chatcmpl", body.request_id)
    await batch.add([ids], params, body.priority)
    if body.stream:
        return _chat_stream(state, body, batch, top, plan, harmony)
    choices, cached, prompt_ids = await collect(batch, body.n, raw)
    tok = state.tokenizer
    echo = _echoed(body)
    data = [{"index": c.index, **_chat_message(c, plan, echo, harmony),
             "logprobs": serving.chat_logprobs(tok, c.token_ids, c.logprobs, top, serving.TokenTexts(tok),
                                               body.return_tokens_as_token_ids)
             if body.logprobs else None, "stop_reason": c.stop_reason} for c in choices]
    response = {"id": batch.id, "object": "chat.completion", "created": serving.now(),
                "model": state.model_name, "choices": data, "usage": serving.usage(choices, prompt_ids, cached)}
    if body.prompt_logprobs is not None:
        response["prompt_logprobs"] = serving.prompt_logprobs(tok, prompt_ids[0], batch.prompt_logprobs[0],
                                                              body.prompt_logprobs)
    return with_transfer(response, batch)


def _echoed(body: ChatCompletionRequest) -> str:
    """vLLM's chat echo: the reply starts with the last message when it is the assistant's."""
    last = body.messages[-1]
    if not body.echo or last.role != "assistant":
        return ""
    content = last.content
    return content if isinstance(content, str) else "".join(str(p.get("text", "")) for p in content or [])


def _chat_message(c: Choice, plan: ToolPlan, echo: str, harmony: bool) -> dict:
    """The assistant message and finish_reason of one choice, with the calls read out of its text
    (of a harmony model: out of its answer, the final channel)."""
    text, extra = c.text, {}
    if harmony:
        text, reasoning = parse_chat_output(c.text)
        extra = _reasoning(reasoning)
    text = echo + text
    message = {"role": "assistant", "content": text, **extra}
    if plan.parser is None:
        return {"message": message, "finish_reason": c.finish_reason}
    content, calls = extract_tool_calls(plan.parser, text)
    calls = calls[:plan.max_calls] if plan.max_calls is not None else calls
    if not calls:
        return {"message": message, "finish_reason": c.finish_reason}
    message = {"role": "assistant", "content": content, **extra,
               "tool_calls": [{"id": t.id, "type": "function",
                               "function": {"name": t.name, "arguments": t.arguments}} for t in calls]}
    return {"message": message, "finish_reason": _tool_finish(c.finish_reason, plan)}


def _reasoning(text: str | None) -> dict:
    """A harmony model's chain of thought under both names clients read: vLLM's older
    reasoning_content and its newer reasoning."""
    return {"reasoning_content": text, "reasoning": text}


def _tool_finish(finish_reason: str | None, plan: ToolPlan) -> str | None:
    """A stop with calls is "tool_calls", except for a forced function (OpenAI and vLLM say "stop")."""
    return "tool_calls" if finish_reason == "stop" and plan.calls_finish else finish_reason


async def _chat_stream(state: ServerState, body: ChatCompletionRequest, batch: Batch, top: int,
                       plan: ToolPlan, harmony: bool):
    tok = state.tokenizer
    head = {"id": batch.id, "object": "chat.completion.chunk", "created": serving.now(),
            "model": state.model_name}
    for j in range(body.n):
        yield {**head, "choices": [{"index": j, "delta": {"role": "assistant", "content": _echoed(body)},
                                    "logprobs": None, "finish_reason": None}]}
    done: set[int] = set()
    sent: dict[int, int] = {}
    token_texts: dict[int, serving.TokenTexts] = {}
    streamers: dict[int, ToolCallStreamer] = {}
    harmonies: dict[int, HarmonyChat] = {}
    last: dict[int, Choice] = {}
    cached, prompt_ids = [0], [[]]
    async for _, out in batch.outputs():
        cached[0], prompt_ids[0] = out.num_cached_tokens, out.prompt_token_ids
        for c in out.outputs:
            if c.index in done:
                continue
            new = c.token_ids[sent.get(c.index, 0):]
            sent[c.index] = len(c.token_ids)
            last[c.index] = Choice(index=c.index, prompt_token_ids=out.prompt_token_ids, token_ids=c.token_ids)
            if not c.delta_text and not new and not c.finish_reason:
                continue
            lp = None
            if body.logprobs and new:
                lp = serving.chat_logprobs(tok, new, c.logprobs[len(c.logprobs) - len(new):], top,
                                           token_texts.setdefault(c.index, serving.TokenTexts(tok)),
                                           body.return_tokens_as_token_ids)
            finish = c.finish_reason
            if finish:
                done.add(c.index)
            text, reasoning = c.delta_text, ""
            if harmony:     # only the answer is content; the chain of thought is reasoning
                split = harmonies.setdefault(c.index, HarmonyChat()).feed(c.delta_text, final=bool(finish))
                text, reasoning = split.content, split.reasoning
            if plan.parser is None:
                delta = {"content": text} if text or not (finish or harmony) else {}
            else:
                streamer = streamers.setdefault(c.index, ToolCallStreamer(plan.parser, plan.max_calls))
                delta = _tool_delta(streamer.feed(text, final=bool(finish)))
                if finish and streamer.has_calls:
                    finish = _tool_finish(finish, plan)
            if reasoning:
                delta = {**_reasoning(reasoning), **delta}
            if (plan.parser is not None or harmony) and not delta and not finish and lp is None:
                continue
            yield {**head, "choices": [{"index": c.index, "delta": delta, "logprobs": lp,
                                        "finish_reason": finish, "stop_reason": c.stop_reason}]}
    if body.stream_options and body.stream_options.include_usage:
        yield {**head, "choices": [], "usage": serving.usage(list(last.values()), prompt_ids, cached)}


def _tool_delta(d: StreamDelta) -> dict:
    delta: dict = {}
    if d.content:
        delta["content"] = d.content
    if d.tool_calls:
        delta["tool_calls"] = d.tool_calls
    return delta
