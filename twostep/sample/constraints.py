"""Step 0 of sampling: what may come next at all, and the caller's bias, before min_tokens,
penalties and temperature (vLLM's order). Per row of a batch's logits ``[B, V]``:

1. the grammar's bitmask (structured outputs): tokens whose bit is clear get ``-inf``;
2. ``allowed_token_ids``: every other token gets ``-inf``;
3. ``bad_words``: a word's last token gets ``-inf`` when the output so far ends with the word's
   other tokens (a one-token word is always banned);
4. ``logit_bias``: added to the logits of its tokens (OpenAI's semantics).

The bitmask is int32 ``[ceil(V / 32)]``, bit ``t % 32`` of word ``t // 32`` set for an allowed
token t (llguidance's packed layout). Rows without any of these are untouched; when no row has
one the input tensor itself comes back.
"""
from __future__ import annotations

from typing import Protocol

import torch

_NEG_INF = float("-inf")


class ConstrainedRow(Protocol):
    params: object                      # SamplingParams
    output_token_ids: list[int]
    token_bitmask: torch.Tensor | None


def has_constraints(row: ConstrainedRow) -> bool:
    return row.token_bitmask is not None or row.params.has_token_constraints


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Packed int32 ``[..., W]`` -> bool ``[..., vocab_size]`` (True: allowed)."""
    bits = torch.ones(32, dtype=torch.int32, device=bitmask.device) << torch.arange(
        32, dtype=torch.int32, device=bitmask.device)     # 1 << 31 is the int32 sign bit
    return (bitmask.unsqueeze(-1) & bits).ne(0).flatten(-2)[..., :vocab_size]


def apply_constraints(logits: torch.Tensor, rows: list[ConstrainedRow]) -> torch.Tensor:
    """Steps 1-4 of the module docstring; a new tensor, or ``logits`` when no row has any."""
    which = [i for i, r in enumerate(rows) if has_constraints(r)]
    if not which:
        return logits
    out = logits.clone()
    _apply_bitmasks_(out, rows, which)
    for i in which:
        _apply_row_(out[i], rows[i])
    return out


def _apply_bitmasks_(logits: torch.Tensor, rows: list[ConstrainedRow], which: list[int]) -> None:
    masked = [i for i in which if rows[i].token_bitmask is not None]
    if not masked:
        return
    dev = logits.device
    packed = torch.stack([rows[i].token_bitmask for i in masked]).to(dev)
    banned = unpack_bitmask(packed, logits.shape[1]).logical_not_()
    if len(masked) == len(rows):
        logits.masked_fill_(banned, _NEG_INF)
    else:
        idx = torch.tensor(masked, device=dev)
        logits[idx] = logits[idx].masked_fill(banned, _NEG_INF)


def _apply_row_(row_logits: torch.Tensor, row: ConstrainedRow) -> None:
    p = row.params
    vocab, dev = row_logits.shape[0], row_logits.device
    if p.allowed_token_ids:
        keep = torch.tensor([t for t in p.allowed_token_ids if t < vocab], dtype=torch.long, device=dev)
        kept = row_logits[keep]
        row_logits.fill_(_NEG_INF)
        row_logits[keep] = kept
    banned = banned_words_next(p.bad_words_token_ids, row.output_token_ids)
    if banned:
        row_logits[torch.tensor([t for t in banned if t < vocab], dtype=torch.long, device=dev)] = _NEG_INF
    if p.logit_bias:
        items = [(t, b) for t, b in p.logit_bias.items() if t < vocab]
        ids = torch.tensor([t for t, _ in items], dtype=torch.long, device=dev)
        row_logits[ids] += torch.tensor([b for _, b in items], dtype=row_logits.dtype, device=dev)


def banned_words_next(words: list[list[int]], output_token_ids: list[int]) -> list[int]:
    """The tokens that would complete a bad word right now."""
    banned = []
    for word in words:
        prefix = word[:-1]
        if not prefix or (len(output_token_ids) >= len(prefix)
                          and output_token_ids[-len(prefix):] == prefix):
            banned.append(word[-1])
    return banned
