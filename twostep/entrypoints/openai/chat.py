"""POST /v1/chat/completions: messages through the chat template, tool calls planned and parsed,
structured outputs, logprobs, streamed or not.

A reasoning model's chain of thought goes to message.reasoning (and reasoning_content, its older
name), never to content: the server's --reasoning-parser splits the output (entrypoints/reasoning.py;
which request gets which parser: reasoning_plan.py), and usage counts the reasoning tokens. A model
that speaks harmony (gpt-oss; entrypoints/harmony.py) generates with its special tokens kept in the
text and stops at <|return|> and <|call|>; its final channel is the answer. Tool calls are read out of
the answer (a harmony tool-call parser reads the whole output: its calls are messages of their own).
"""
from __future__ import annotations

from fastapi import Request

from twostep.entrypoints.harmony import is_harmony_tokenizer, turn_end_token_ids
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
from twostep.entrypoints.reasoning_plan import ReasoningPlan, defer_constraint, plan_reasoning
from twostep.entrypoints.openai.serving import Choice
from twostep.entrypoints.openai.sse import sse_response
from twostep.entrypoints.openai.state import ServerState
from twostep.entrypoints.openai.tool_choice import ToolChoiceError, ToolPlan, plan_tools
from twostep.entrypoints.openai.tool_parsers import StreamDelta, ToolCallStreamer, extract_tool_calls
from twostep.entrypoints.reasoning import ReasoningDelta, ReasoningSplit, count_reasoning_tokens


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
    reasoning = plan_reasoning(state.tokenizer, state.config.reasoning_parser,
                               state.config.structured_outputs_in_reasoning, body.chat_template_kwargs, ids)
    defer_constraint(reasoning, params)
    await compile_constraint(state, params)
    batch = Batch(state, "chatcmpl", body.request_id)
    await batch.add([ids], params, body.priority)
    if body.stream:
        return _chat_stream(state, body, batch, top, plan, reasoning, params.skip_special_tokens)
    choices, cached, prompt_ids = await collect(batch, body.n, raw)
    tok = state.tokenizer
    echo = _echoed(body)
    data = [{"index": c.index, **_chat_message(c, plan, echo, reasoning),
             "logprobs": serving.chat_logprobs(tok, c.token_ids, c.logprobs, top, serving.TokenTexts(tok),
                                               body.return_tokens_as_token_ids)
             if body.logprobs else None, "stop_reason": c.stop_reason} for c in choices]
    response = {"id": batch.id, "object": "chat.completion", "created": serving.now(),
                "model": state.model_name, "choices": data,
                "usage": _usage(state, choices, prompt_ids, cached, reasoning, params.skip_special_tokens)}
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


def _chat_message(c: Choice, plan: ToolPlan, echo: str, reasoning: ReasoningPlan) -> dict:
    """The assistant message and finish_reason of one choice: its reasoning split off, and the calls
    read out of its answer."""
    split = ReasoningSplit("", c.text)
    if reasoning.parser is not None:
        split = reasoning.parser.split(c.text, final=True)
    extra = _reasoning(split.reasoning or None)       # null without reasoning, as vLLM answers
    text = echo + split.content
    message = {"role": "assistant", "content": text if text or reasoning.parser is None else None, **extra}
    if plan.parser is None:
        return {"message": message, "finish_reason": c.finish_reason}
    content, calls = extract_tool_calls(plan.parser, c.text if plan.parser.reads_harmony else text)
    calls = calls[:plan.max_calls] if plan.max_calls is not None else calls
    if not calls:
        return {"message": message, "finish_reason": c.finish_reason}
    message = {"role": "assistant", "content": content, **extra,
               "tool_calls": [{"id": t.id, "type": "function",
                               "function": {"name": t.name, "arguments": t.arguments}} for t in calls]}
    return {"message": message, "finish_reason": _tool_finish(c.finish_reason, plan)}


def _reasoning(text: str | None) -> dict:
    """The chain of thought under both names clients read: vLLM's newer reasoning and its older
    reasoning_content (DeepSeek's and llama.cpp's name)."""
    return {"reasoning": text, "reasoning_content": text}


def _usage(state: ServerState, choices: list[Choice], prompt_ids: list[list[int]], cached: list[int],
           reasoning: ReasoningPlan, skip_special_tokens: bool) -> dict:
    """OpenAI's usage; with a reasoning parser, completion_tokens_details.reasoning_tokens."""
    out = serving.usage(choices, prompt_ids, cached)
    if reasoning.parser is not None:
        decode = lambda ids: state.tokenizer.decode(ids, skip_special_tokens)  # noqa: E731
        out["completion_tokens_details"] = {"reasoning_tokens": sum(
            count_reasoning_tokens(reasoning.parser, c.text, c.token_ids, decode) for c in choices)}
    return out


def _tool_finish(finish_reason: str | None, plan: ToolPlan) -> str | None:
    """A stop with calls is "tool_calls", except for a forced function (OpenAI and vLLM say "stop")."""
    return "tool_calls" if finish_reason == "stop" and plan.calls_finish else finish_reason


async def _chat_stream(state: ServerState, body: ChatCompletionRequest, batch: Batch, top: int,
                       plan: ToolPlan, reasoning: ReasoningPlan, skip_special_tokens: bool):
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
    splits = {}
    last: dict[int, Choice] = {}
    cached, prompt_ids = [0], [[]]
    async for _, out in batch.outputs():
        cached[0], prompt_ids[0] = out.num_cached_tokens, out.prompt_token_ids
        for c in out.outputs:
            if c.index in done:
                continue
            new = c.token_ids[sent.get(c.index, 0):]
            sent[c.index] = len(c.token_ids)
            text_so_far = (last[c.index].text if c.index in last else "") + c.delta_text
            last[c.index] = Choice(index=c.index, prompt_token_ids=out.prompt_token_ids, text=text_so_far,
                                   token_ids=c.token_ids)
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
            split = ReasoningDelta(content=c.delta_text)
            if reasoning.parser is not None:   # only the answer is content; the chain of thought is reasoning
                if c.index not in splits:
                    splits[c.index] = reasoning.parser.stream()
                split = splits[c.index].feed(c.delta_text, final=bool(finish))
            if plan.parser is None:
                delta = {"content": split.content} if split.content or not (finish or reasoning.parser) else {}
            else:
                streamer = streamers.setdefault(c.index, ToolCallStreamer(plan.parser, plan.max_calls))
                tool_text = c.delta_text if plan.parser.reads_harmony else split.content
                delta = _tool_delta(streamer.feed(tool_text, final=bool(finish)))
                if finish and streamer.has_calls:
                    finish = _tool_finish(finish, plan)
            if split.reasoning:
                delta = {**_reasoning(split.reasoning), **delta}
            if (plan.parser is not None or reasoning.parser) and not delta and not finish and lp is None:
                continue
            yield {**head, "choices": [{"index": c.index, "delta": delta, "logprobs": lp,
                                        "finish_reason": finish, "stop_reason": c.stop_reason}]}
    if body.stream_options and body.stream_options.include_usage:
        yield {**head, "choices": [], "usage": _usage(state, list(last.values()), prompt_ids, cached, reasoning,
                                                      skip_special_tokens)}


def _tool_delta(d: StreamDelta) -> dict:
    delta: dict = {}
    if d.content:
        delta["content"] = d.content
    if d.tool_calls:
        delta["tool_calls"] = d.tool_calls
    return delta
