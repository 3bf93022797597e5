"""One request's grammar state: which tokens may come next, advanced by every token the request
keeps. The scheduler owns it (it advances it after each step and asks it for the next step's
bitmask); the sampler only ever sees the bitmask.

A bitmask is int32 ``[ceil(V / 32)]``: bit ``t % 32`` of word ``t // 32`` is set when token t is
allowed (llguidance's layout). EOS is in it only where the grammar can end.

A DeferredGrammar starts only after a marker in the output (structured outputs of a reasoning model
constrain its answer, not its thinking).
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


class DeferredGrammar:
    """A grammar that starts after a marker: until the output's tokens end with ``marker`` (a
    reasoning model's end of thinking, as token ids) every token is allowed and none is fed to the
    grammar; from then on it is the grammar. The same interface as Grammar, for the scheduler."""

    def __init__(self, grammar: Grammar, marker: list[int]) -> None:
        if not marker:
            raise ValueError("a deferred grammar needs a non-empty marker")
        self.grammar = grammar
        self.marker = list(marker)
        self.started = False
        self._tail: list[int] = []       # the last len(marker) tokens before the start

    def accept(self, token_id: int) -> bool:
        if self.started:
            return self.grammar.accept(token_id)
        self._tail = self._after(self._tail, token_id)
        self.started = self._tail == self.marker
        return True

    def _after(self, tail: list[int], token_id: int) -> list[int]:
        return (tail + [token_id])[-len(self.marker):]

    def _start_index(self, token_ids: list[int]) -> int | None:
        """The index in token_ids after which the grammar would start (None: not within them)."""
        if self.started:
            return 0
        tail = self._tail
        for i, t in enumerate(token_ids):
            tail = self._after(tail, t)
            if tail == self.marker:
                return i + 1
        return None

    def valid_prefix(self, token_ids: list[int]) -> int:
        start = self._start_index(token_ids)
        if start is None:
            return len(token_ids)
        return start + self.grammar.valid_prefix(token_ids[start:])

    def drafts_to_verify(self, token_ids: list[int]) -> int:
        start = self._start_index(token_ids)
        if start is None:
            return len(token_ids)
        return start + self.grammar.drafts_to_verify(token_ids[start:])

    @property
    def is_terminated(self) -> bool:
        return self.started and self.grammar.is_terminated

    @property
    def is_error(self) -> bool:
        return self.started and self.grammar.is_error

    def bitmask(self, draft_token_ids: list[int] | None = None) -> torch.Tensor:
        """Rows up to the marker allow everything; the rest are the grammar's."""
        drafts = draft_token_ids or []
        start = self._start_index(drafts)
        if start == 0:
            return self.grammar.bitmask(drafts)
        out = torch.full((1 + len(drafts), bitmask_width(self.grammar.vocab_size)), -1, dtype=torch.int32)
        if start is not None:        # a draft completes the marker: the grammar's rows after it
            out[start:] = self.grammar.bitmask(drafts[start:])
        return out
