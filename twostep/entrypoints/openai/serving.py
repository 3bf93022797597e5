"""Turning RequestOutputs into OpenAI response bodies and stream chunks (completions and chat)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from twostep.tokenizer.tokenizer import Tokenizer
from twostep.outputs import CompletionOutput, PositionLogprobs, RequestOutput


@dataclass
class Choice:
    """One choice's state while a response is built (prompt i, sample j -> index i * n + j)."""

    index: int
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0


def token_text(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


class TokenTexts:
    """Each token's share of the decoded text, in order: a token holding only part of a
    character gets "" and the token completing it gets the whole character, so the texts
    concatenate to the decoded text and text_offset stays aligned (as vLLM does)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._stream = tokenizer.new_decode_stream(skip_special_tokens=False)
        self.offset = 0

    def next(self, token_ids: list[int]) -> tuple[list[str], list[int]]:
        texts, offsets = [], []
        for tid in token_ids:
            text = self._stream.step(tid) or ""
            texts.append(text)
            offsets.append(self.offset)
            self.offset += len(text)
        return texts, offsets


def token_label(tokenizer: Tokenizer, token_id: int, as_id: bool) -> str:
    """A token as logprobs name it: its text, or with return_tokens_as_token_ids "token_id:N"."""
    return f"token_id:{token_id}" if as_id else token_text(tokenizer, token_id)


def completion_logprobs(tokenizer: Tokenizer, token_ids: list[int],
                        entries: list[PositionLogprobs | None], texts: TokenTexts, as_ids: bool = False) -> dict:
    """OpenAI's legacy completions logprobs: parallel lists, first prompt token's logprob None."""
    tokens, offsets = texts.next(token_ids)
    if as_ids:
        tokens = [token_label(tokenizer, t, True) for t in token_ids]
    token_lps, tops = [], []
    for tid, entry in zip(token_ids, entries):
        if entry is None:
            token_lps.append(None)
            tops.append(None)
            continue
        token_lps.append(entry[tid].logprob if tid in entry else None)
        tops.append({token_label(tokenizer, k, as_ids): v.logprob for k, v in
                     sorted(entry.items(), key=lambda kv: (kv[1].rank or 0, kv[0]))})
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(tokenizer: Tokenizer, token_ids: list[int], entries: list[PositionLogprobs],
                  top_n: int, texts: TokenTexts, as_ids: bool = False) -> dict:
    content = []
    tokens, _ = texts.next(token_ids)
    for tid, text, entry in zip(token_ids, tokens, entries):
        ranked = sorted(entry.items(), key=lambda kv: (kv[1].rank or 0, kv[0]))[:top_n]
        label = token_label(tokenizer, tid, True) if as_ids else text
        content.append({
            "token": label, "logprob": entry[tid].logprob, "bytes": list(text.encode()),
            "top_logprobs": [{"token": token_label(tokenizer, k, as_ids), "logprob": v.logprob,
                              "bytes": list(token_text(tokenizer, k).encode())} for k, v in ranked],
        })
    return {"content": content}


def prompt_logprobs(tokenizer: Tokenizer, prompt_ids: list[int], entries: list[PositionLogprobs | None] | None,
                    top_n: int) -> list[dict | None]:
    """vLLM's prompt_logprobs: per prompt token None (the first) or {token id: {logprob, rank,
    decoded_token}} holding the prompt token and the top_n most likely."""
    entries = entries or [None] * len(prompt_ids)
    out: list[dict | None] = []
    for tid, entry in zip(prompt_ids, entries):
        if entry is None:
            out.append(None)
            continue
        ranked = sorted(entry.items(), key=lambda kv: (kv[1].rank or 0, kv[0]))
        keep = [(k, v) for k, v in ranked if k == tid] + [(k, v) for k, v in ranked if k != tid][:top_n]
        out.append({str(k): {"logprob": v.logprob, "rank": v.rank, "decoded_token": token_text(tokenizer, k)}
                    for k, v in keep})
    return out


def usage(choices: list[Choice], prompts: list[list[int]], cached: list[int]) -> dict:
    prompt_tokens = sum(len(p) for p in prompts)
    completion_tokens = sum(len(c.token_ids) for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(cached)}}


def now() -> int:
    return int(time.time())


def changed_completions(out: RequestOutput) -> list[CompletionOutput]:
    """Completions of this output that carry something new (text, tokens or a finish)."""
    return [c for c in out.outputs if c.delta_text or c.delta_token_ids or c.finish_reason]
