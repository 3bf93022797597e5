"""Continuous batching with chunked prefill under one rule (vLLM v1's counter model).

Every step has a budget of max_num_batched_tokens. Each scheduled request gets
min(tokens it still needs, budget left) tokens: one for a decode, a chunk for a prefill, and
for a decode with speculative drafts also the drafts to verify (after every decode has its
own token; drafts that do not fit are cut). Running decodes go first, then running partial prefills, then waiting requests, so a long
prompt never stalls the decodes. When the KV cache is full the newest running request is
preempted: its blocks are freed and it is recomputed later from its tokens.
"""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

import torch

from twostep.core.request import Request, RequestStatus
from twostep.kv.kv_cache_manager import KVCacheManager

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_tokens: int                  # tokens computed for it this step (drafts included)
    start: int                       # its num_computed_tokens before the step
    spec_token_ids: list[int] = field(default_factory=list)   # drafts verified this step
    spec_draft_probs: torch.Tensor | None = None              # their draft distributions [k, V]

    @property
    def num_known_tokens(self) -> int:
        return self.num_tokens - len(self.spec_token_ids)

    @property
    def is_decode(self) -> bool:
        """One new token past the prompt (plus drafts to verify); prompt chunks and
        recomputation after preemption are prefill work."""
        return self.num_known_tokens == 1 and self.start >= self.request.num_prompt_tokens

    @property
    def completes_known_tokens(self) -> bool:
        """After this step every known token is cached, so the step samples its next token."""
        return self.start + self.num_known_tokens == self.request.num_tokens

    def input_token_ids(self) -> list[int]:
        """Tokens start .. start + num_tokens of the request's tokens followed by the drafts."""
        known, end = self.request.all_token_ids, self.start + self.num_tokens
        head = known[self.start:end] if self.start < len(known) else []
        if end <= len(known):
            return head
        return head + self.spec_token_ids[max(self.start - len(known), 0):end - len(known)]


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    cannot_fit: list[Request] = field(default_factory=list)   # alone and still no room: end them

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        # Every decode's own token comes before any request's drafts.
        decodes_left = sum(not r.is_prefilling for r in self.running)
        # Decodes first, then partial prefills; sorted() is stable, so arrival order holds.
        for request in sorted(self.running, key=lambda r: r.is_prefilling):
            budget = self.max_num_batched_tokens - out.num_tokens  # preemption refunds tokens
            if budget == 0:
                break
            if request not in self.running:      # preempted earlier in this loop
                continue
            decodes_left -= not request.is_prefilling
            if self._schedule_draft(request, budget - decodes_left, out):
                continue
            n = min(request.num_tokens_to_compute, budget)
            if self._make_room(request, n, out):
                out.scheduled.append(ScheduledRequest(request, n, request.num_computed_tokens))
        if not out.preempted:
            self._admit_waiting(self.max_num_batched_tokens - out.num_tokens, out)
        return out

    def _schedule_draft(self, request: Request, budget: int, out: SchedulerOutput) -> bool:
        """A decode with drafts verifies them too, as budget and free blocks allow (drafts
        are tokens to compute); without room it falls back to a plain decode."""
        drafts = request.spec_token_ids[:max(budget - 1, 0)]
        if (not drafts or request.num_tokens_to_compute != 1
                or not self.kv.allocate_slots(request.request_id, request.num_computed_tokens,
                                              1 + len(drafts))):
            request.clear_draft()
            return False
        probs = request.spec_draft_probs
        out.scheduled.append(ScheduledRequest(request, 1 + len(drafts), request.num_computed_tokens,
                                              drafts, None if probs is None else probs[:len(drafts)]))
        request.clear_draft()       # consumed: the next proposal follows this step's outcome
        return True

    def _make_room(self, request: Request, n: int, out: SchedulerOutput) -> bool:
        """Allocate n more slots for a running request, preempting the newest others if needed."""
        while not self.kv.allocate_slots(request.request_id, request.num_computed_tokens, n):
            victim = self.running[-1]
            if victim is request:
                if len(self.running) == 1:
                    out.cannot_fit.append(request)
                self._preempt(request, out)
                return False
            self._preempt(victim, out)
        return True

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.running.remove(request)
        self.kv.free(request.request_id)
        request.num_computed_tokens = 0
        request.clear_draft()
        request.status = RequestStatus.PREEMPTED
        request.metrics.num_preemptions += 1
        self.num_preemptions += 1
        out.scheduled = [s for s in out.scheduled if s.request is not request]
        if request not in out.cannot_fit:
            self.waiting.appendleft(request)
            out.preempted.append(request)
            logger.debug("preempted %s (recompute later)", request.request_id)

    def _admit_waiting(self, budget: int, out: SchedulerOutput) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            hits, num_hit = self._prefix_hits(request)
            n = min(request.num_tokens - num_hit, budget)
            if not self.kv.allocate_slots(request.request_id, num_hit, n, hits):
                break
            request.num_computed_tokens = num_hit
            if not request.wants_prompt_logprobs:
                self.kv.record_lookup(request.num_tokens, num_hit)
            if request.metrics.first_scheduled_time is None:
                request.metrics.num_cached_tokens = num_hit
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(ScheduledRequest(request, n, request.num_computed_tokens))
            budget -= n

    def _prefix_hits(self, request: Request):
        """Cached leading blocks of a request starting from scratch (new or preempted).
        Requests that want prompt_logprobs compute every prompt position themselves."""
        if request.num_computed_tokens or request.wants_prompt_logprobs:
            return [], request.num_computed_tokens
        return self.kv.get_computed_blocks(request.request_id, request.all_token_ids)

    def finish(self, request: Request) -> None:
        """Remove a finished or aborted request wherever it is and free its blocks."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv.free(request.request_id)
        request.status = RequestStatus.FINISHED
