"""One request's grammar state: which tokens may come next, advanced by every token the request
keeps. The scheduler owns it (it advances it after each step and asks it for the next step's
bitmask); the sampler only ever sees the bitmask.

A bitmask is int32 ``[ceil(V / 32)]``: bit ``t % 32`` of word ``t // 32`` is set when token t is
allowed (llguidance's layout). EOS is in it only where the grammar can end.
"""
from __future__ import annotations

import logging

import llguidance
import torch

logger = logging.getLogger(__name__)


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class Grammar:
    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.num_tokens = 0          # tokens accepted so far (the request's output tokens)

    def accept(self, token_id: int) -> bool:
        """Advance by one generated token; False (and an error state) if the grammar forbids it."""
        ok = self.matcher.consume_token(token_id)
        if ok:
            self.num_tokens += 1
        else:
            logger.warning("grammar refused token %d: %s", token_id, self.matcher.get_error())
        return ok

    def valid_prefix(self, token_ids: list[int]) -> int:
        """How many of these tokens the grammar would accept in a row, counting up to (not
        including) an EOS; no state change."""
        if not token_ids or self.is_terminated:
            return 0
        end = next((i for i, t in enumerate(token_ids) if t in self.eos_token_ids), len(token_ids))
        return self.matcher.validate_tokens(token_ids[:end]) if end else 0

    def drafts_to_verify(self, token_ids: list[int]) -> int:
        """How many drafts a verification step takes: those the grammar accepts, plus the first
        one it refuses or the first EOS. Verification then decides that one by the target's
        masked distribution (a refused draft has probability 0 there, so it is rejected and the
        residual is drawn), which keeps speculative sampling exact; later drafts could never be kept."""
        if not token_ids or self.is_terminated:
            return 0
        return min(self.valid_prefix(token_ids) + 1, len(token_ids))

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and allows no more tokens (only EOS): the request is done."""
        return self.matcher.is_stopped()

    @property
    def is_error(self) -> bool:
        return self.matcher.is_error()

    def bitmask(self, draft_token_ids: list[int] | None = None) -> torch.Tensor:
        """Allowed tokens ``[1 + len(drafts), W]``: row 0 for the next token, row i for the token
        after drafts[:i] (a verification step scores every draft position). Past a draft the
        grammar refuses, or an EOS, rows allow everything: verification stops there, so they are
        never used. The state is back where it was afterwards."""
        drafts = draft_token_ids or []
        out = torch.full((1 + len(drafts), bitmask_width(self.vocab_size)), -1, dtype=torch.int32)
        consumed = 0
        for i in range(len(drafts) + 1):
            self._fill(out[i])
            if i == len(drafts) or drafts[i] in self.eos_token_ids or not self._try_consume(drafts[i]):
                break
            consumed += 1
        if consumed:
            self.matcher.rollback(consumed)
        return out

    def _try_consume(self, token_id: int) -> bool:
        return self.matcher.validate_tokens([token_id]) == 1 and self.matcher.consume_token(token_id)

    def _fill(self, row: torch.Tensor) -> None:
        self.matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())
