"""POST /v1/completions: one or many prompts, n samples each, echo, logprobs, streamed or not.
"""
from __future__ import annotations

import dataclasses

from fastapi import Request

from twostep.entrypoints.openai import serving
from twostep.entrypoints.openai.errors import APIError
from twostep.entrypoints.openai.fan_out import Batch, collect, with_transfer
from twostep.entrypoints.openai.protocol import CompletionRequest
from twostep.entrypoints.openai.request_checks import (
    check_fan_out,
    check_length,
    check_logprobs,
    check_model,
    check_prompt_logprobs,
    compile_constraint,
    encode_prompts,
    request_params,
)
from twostep.entrypoints.openai.serving import Choice
from twostep.entrypoints.openai.sse import sse_response
from twostep.entrypoints.openai.state import ServerState


async def create_completion(state: ServerState, body: CompletionRequest, raw: Request):
    check_model(state, body.model)
    if body.best_of not in (None, body.n):
        raise APIError(400, "best_of is not supported (only best_of == n)", "best_of")
    prompts = body.prompts()
    if not prompts:
        raise APIError(400, "prompt is empty", "prompt")
    if body.kv_transfer_params is not None and len(prompts) > 1:
        raise APIError(400, "kv_transfer_params take one prompt per request", "kv_transfer_params")
    if body.max_tokens is not None and body.max_tokens < 0:
        raise APIError(400, f"max_tokens must be >= 0, got {body.max_tokens}", "max_tokens")
    if body.max_tokens == 0 and not body.echo:
        # vLLM's answer (max_tokens 0 is only for echo: prompt logprobs without generating)
        raise APIError(400, "max_tokens must be at least 1, got 0 (0 only with echo: true)", "max_tokens")
    max_tokens = 1 if body.max_tokens == 0 else body.max_tokens   # echo-only: drop the token later
    check_prompt_logprobs(state, body)
    prompt_lps = body.logprobs if body.echo and body.logprobs is not None else None
    if body.prompt_logprobs is not None:
        prompt_lps = max(body.prompt_logprobs, prompt_lps or 0)
    check_logprobs(state, "logprobs", body.logprobs)
    params = request_params(state, body, max_tokens, body.logprobs, prompt_lps)
    await compile_constraint(state, params)
    check_fan_out(state, len(prompts), body.n)
    prompt_ids = [body.truncate(ids) for ids in await encode_prompts(state, prompts, body.add_special_tokens)]
    note = "" if "max_tokens" in body.model_fields_set else " (the default)"
    for ids in prompt_ids:
        check_length(state, ids, max_tokens, "prompt", note)
    batch = Batch(state, "cmpl", body.request_id)
    await batch.add(prompt_ids, params, body.priority)
    if body.stream:
        return sse_response(_completion_stream(state, body, batch))
    choices, cached, prompt_ids = await collect(batch, body.n, raw)
    if body.max_tokens == 0:
        for c in choices:
            c.text, c.token_ids, c.logprobs, c.finish_reason = "", [], [] if c.logprobs else None, "length"
    tok = state.tokenizer
    data = []
    for c in choices:
        text, lp = c.text, None
        if body.echo:
            prompt = prompts[c.index // body.n]
            prompt_text = prompt if isinstance(prompt, str) else tok.decode(prompt)
            text = prompt_text + text
        if body.logprobs is not None:
            ids, entries = c.token_ids, list(c.logprobs or [])
            if body.echo:
                prompt_lps = batch.prompt_logprobs[c.index // body.n] or [None] * len(c.prompt_token_ids)
                ids = c.prompt_token_ids + ids
                entries = list(prompt_lps) + entries
            lp = serving.completion_logprobs(tok, ids, entries, serving.TokenTexts(tok),
                                             body.return_tokens_as_token_ids)
        choice = {"index": c.index, "text": text, "logprobs": lp, "finish_reason": c.finish_reason,
                  "stop_reason": c.stop_reason}
        if body.prompt_logprobs is not None:
            choice["prompt_logprobs"] = serving.prompt_logprobs(
                tok, c.prompt_token_ids, batch.prompt_logprobs[c.index // body.n], body.prompt_logprobs)
        data.append(choice)
    return with_transfer({"id": batch.id, "object": "text_completion", "created": serving.now(),
                           "model": state.model_name, "choices": data,
                           "usage": serving.usage(choices, prompt_ids, cached)}, batch)


async def _completion_stream(state: ServerState, body: CompletionRequest, batch: Batch):
    tok, n = state.tokenizer, body.n
    head = {"id": batch.id, "object": "text_completion", "created": serving.now(),
            "model": state.model_name}
    started: set[int] = set()
    done: set[int] = set()
    sent_tokens: dict[int, int] = {}
    token_texts: dict[int, serving.TokenTexts] = {}
    choices: dict[int, Choice] = {}
    prompts = body.prompts()
    cached = [0] * len(prompts)
    prompt_ids: list[list[int]] = [[] for _ in prompts]
    async for i, out in batch.outputs():
        cached[i], prompt_ids[i] = out.num_cached_tokens, out.prompt_token_ids
        for c in out.outputs:
            index = i * n + c.index
            if index in done:
                continue
            text, lp = c.delta_text, None
            entries_ids: list[int] = []
            entries: list = []
            if body.max_tokens == 0:
                text, c = "", _as_echo_only(c)
            if body.echo and index not in started:
                prompt = prompts[i]
                text = (prompt if isinstance(prompt, str) else tok.decode(prompt)) + text
                if body.logprobs is not None:
                    entries_ids, entries = list(out.prompt_token_ids), list(out.prompt_logprobs or
                                                                           [None] * len(out.prompt_token_ids))
            started.add(index)
            new = c.token_ids[sent_tokens.get(index, 0):]
            sent_tokens[index] = len(c.token_ids)
            if body.logprobs is not None:
                entries_ids += new
                entries += (c.logprobs or [])[len(c.logprobs or []) - len(new):] if new else []
                texts = token_texts.setdefault(index, serving.TokenTexts(tok))
                lp = serving.completion_logprobs(tok, entries_ids, entries, texts, body.return_tokens_as_token_ids)
            if not text and not new and not c.finish_reason:
                continue
            choices[index] = Choice(index=index, prompt_token_ids=out.prompt_token_ids,
                                    token_ids=c.token_ids)
            if c.finish_reason:
                done.add(index)
            yield {**head, "choices": [{"index": index, "text": text, "logprobs": lp,
                                        "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}]}
    if body.stream_options and body.stream_options.include_usage:
        yield {**head, "choices": [], "usage": serving.usage(list(choices.values()), prompt_ids, cached)}


def _as_echo_only(c):
    return dataclasses.replace(c, token_ids=[], logprobs=[] if c.logprobs is not None else None,
                               delta_text="", delta_token_ids=[],
                               finish_reason="length" if c.finish_reason else None)
