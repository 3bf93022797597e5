"""Continuous batching with chunked prefill under one rule (vLLM v1's counter model).

Every step has a budget of max_num_batched_tokens. Each scheduled request gets
min(tokens it still needs, budget left) tokens: one for a decode, a chunk for a prefill, and
for a decode with speculative drafts also the drafts to verify (after every decode has its
own token; drafts that do not fit are cut). Running decodes go first, then running partial prefills, then waiting requests, so a long
prompt never stalls the decodes. When the KV cache is full the newest running request is
preempted: its blocks are freed and it is recomputed later from its tokens.

After the model ran, update_from_output() applies the step to the requests and the KV cache:
computed tokens, appended tokens (accepted drafts included), rejected draft slots trimmed, full
blocks registered in the prefix cache, stop rules (core/scheduling/stop.py), finished requests' blocks freed.
A pooling request is a prompt like any other (chunked, batched, preempted); the step that completes
its prompt returns its pooled vector instead of a token, and it finishes then.
Nothing else writes request or KV state after a step (vLLM v1's Scheduler.update_from_output);
of a request's RequestMetrics it writes the scheduling fields, the output processor the token
timings.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Iterable

import torch

from twostep.core.scheduling.request import Request, RequestStatus
from twostep.core.scheduling.runner_record import RunnerRecord
from twostep.core.scheduling.scheduler_output import ScheduledRequest, SchedulerOutput
from twostep.core.scheduling.stop import check_stop
from twostep.core.step_outputs import EngineCoreOutput, ModelRunnerOutput, StepResult
from twostep.kv.kv_cache_manager import KVCacheManager
from twostep.kv_transfer.connector import KVConnector
from twostep.outputs import SpecDecodeStats

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class SchedulerStats:
    """Counters since start; figures are derived from these, never estimated."""

    num_steps: int = 0
    num_prefill_tokens: int = 0      # prompt (and recomputed) tokens pushed through the model
    num_preemptions: int = 0
    peak_blocks_used: int = 0


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 policy: str = "fcfs", connector: KVConnector | None = None) -> None:
        self.kv = kv
        self.connector = connector       # prefill/decode disaggregation, when configured
        self.policy = policy             # fcfs, or priority: admit the lowest (priority, arrival) first
        self._arrivals = 0
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.requests: dict[str, Request] = {}       # every request not yet finished
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.stats = SchedulerStats()
        self.spec_stats = SpecDecodeStats()
        self._released: list[str] = []               # finished or preempted, not yet taken
        self.loading: dict[str, Request] = {}        # waiting for their prompt's remote KV blocks
        self.sending: dict[str, Request] = {}        # finished; blocks held for a remote decode
        self.runner_record = RunnerRecord()          # what the model runner holds (each step's plan)

    @property
    def num_preemptions(self) -> int:
        return self.stats.num_preemptions

    def add_request(self, request: Request) -> None:
        self._arrivals += 1
        request.arrival_index = self._arrivals
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)
        if request.remote_prefill is not None:
            self.connector.expect(request.request_id, request.remote_prefill)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    # ---- schedule ----------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if self.connector is not None:
            self._poll_transfers(out)
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
        for request in out.finished:
            if request.is_finished:          # a failed remote load, already ended
                continue
            logger.warning("request %s no longer fits in the whole KV cache; ending it",
                           request.request_id)
            self._finish(request, "length")
        now = time.monotonic()
        for s in out.scheduled:
            s.tables = self.kv.tables(s.request.request_id)
            s.state = self.kv.state_step(s.request.request_id, s.start, s.num_tokens, s.request.num_prompt_tokens)
            if s.request.metrics.first_scheduled_time is None:
                s.request.metrics.first_scheduled_time = now
            grammar = s.request.grammar
            if grammar is not None and (s.spec_token_ids or s.completes_known_tokens):
                s.token_bitmask = grammar.bitmask(s.spec_token_ids)
        out.plan = self.runner_record.plan(out.scheduled)
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
            victim = self._victim()
            if victim is request:
                # alone and still too big: it can never fit, unless blocks held for a while (loads
                # in flight, leases for remote decodes) are what is missing; then it waits
                if len(self.running) == 1 and not self.loading and not self.sending:
                    out.finished.append(request)
                self._preempt(request, out)
                return False
            self._preempt(victim, out)
        return True

    def _victim(self) -> Request:
        """Who is preempted when the cache is full: the newest running request; with the priority
        policy the one with the highest (priority, arrival)."""
        if self.policy == "priority":
            return max(self.running, key=_rank)
        return self.running[-1]

    def _next_waiting(self) -> Request:
        if self.policy == "priority":
            return min(self.waiting, key=_rank)
        return self.waiting[0]

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.running.remove(request)
        self.kv.free(request.request_id)
        request.num_computed_tokens = 0
        request.clear_draft()
        request.status = RequestStatus.PREEMPTED
        request.metrics.num_preemptions += 1
        self.stats.num_preemptions += 1
        self._released.append(request.request_id)
        self.runner_record.forget(request.request_id)
        out.scheduled = [s for s in out.scheduled if s.request is not request]
        if request not in out.finished:
            self.waiting.appendleft(request)
            out.preempted.append(request)
            logger.debug("preempted %s (recompute later)", request.request_id)

    def _admit_waiting(self, budget: int, out: SchedulerOutput) -> None:
        while self.waiting and budget > 0 and len(self.running) + len(self.loading) < self.max_num_seqs:
            request = self._next_waiting()
            hits, num_hit = self._prefix_hits(request)
            if request.remote_prefill is not None:
                if not self._start_remote_load(request, hits, num_hit):
                    break
                continue
            n = min(request.num_tokens - num_hit, budget)
            if not self.kv.allocate_slots(request.request_id, num_hit, n, hits):
                break
            request.num_computed_tokens = num_hit
            if not request.wants_prompt_logprobs and not request.pools_every_position:
                self.kv.record_lookup(request.num_tokens, num_hit)
            if request.metrics.first_scheduled_time is None:
                request.metrics.num_cached_tokens = num_hit
            self.waiting.remove(request)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(ScheduledRequest(request, n, request.num_computed_tokens))
            budget -= n

    # ---- remote prefill (prefill/decode disaggregation) ----------------------------------------

    def _start_remote_load(self, request: Request, hits, num_hit: int) -> bool:
        """Blocks for the whole prompt, local prefix-cache hits first; the rest are loaded from
        the producer while the request waits (it computes no tokens meanwhile)."""
        rid = request.request_id
        if not self.kv.allocate_slots(rid, num_hit, request.num_prompt_tokens - num_hit, hits):
            return False
        first = num_hit // self.kv.block_size
        self.connector.start_load(rid, request.remote_prefill, first, self.kv.block_ids(rid)[first:])
        self.kv.record_lookup(request.num_tokens, num_hit)
        m, now = request.metrics, time.monotonic()
        m.first_scheduled_time, m.kv_load_start_time, m.num_cached_tokens = now, now, num_hit
        request.num_computed_tokens = num_hit
        self.waiting.remove(request)
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.loading[rid] = request
        return True

    def _poll_transfers(self, out: SchedulerOutput) -> None:
        """Apply the transfers that ended: a producer frees blocks a consumer has read (or whose
        lease ran out); a consumer runs requests whose blocks arrived, from the last prompt token
        (vLLM's rule: computing it gives the logits), and handles failed loads by its policy."""
        events = self.connector.get_finished()
        for rid in events.finished_sending:
            if self.sending.pop(rid, None) is not None:
                self.kv.free(rid)
        now = time.monotonic()
        for rid, num_bytes in events.finished_recving.items():
            request = self.loading.pop(rid, None)
            if request is None:
                continue
            m, last = request.metrics, request.num_prompt_tokens - 1
            m.kv_load_end_time, m.kv_transfer_bytes = now, num_bytes
            m.num_remote_tokens = last - request.num_computed_tokens
            request.num_computed_tokens = last
            self.kv.cache_full_blocks(rid, request.all_token_ids, last)
            request.remote_prefill = None
            request.status = RequestStatus.RUNNING
            self.running.append(request)
        for rid, error in events.failed_recving.items():
            request = self.loading.pop(rid, None)
            if request is not None:
                self._load_failed(request, error, out)

    def _load_failed(self, request: Request, error: str, out: SchedulerOutput) -> None:
        request.metrics.kv_load_end_time = time.monotonic()
        self.kv.free(request.request_id)
        request.num_computed_tokens = 0
        request.remote_prefill = None
        if self.connector.failure_policy == "recompute":
            logger.warning("request %s: %s; computing its prompt here (kv_load_failure_policy recompute)",
                           request.request_id, error)
            request.status = RequestStatus.WAITING
            self.waiting.appendleft(request)
            return
        self._finish(request, "error", error)
        out.finished.append(request)

    def _prefix_hits(self, request: Request):
        """Cached leading blocks of a request starting from scratch (new or preempted).
        Requests that want prompt_logprobs compute every prompt position themselves, as do pooling
        requests that read every position's hidden state (the cache holds K/V, not hidden states)."""
        if request.num_computed_tokens or request.wants_prompt_logprobs or request.pools_every_position:
            return [], request.num_computed_tokens
        return self.kv.get_computed_blocks(request.request_id, request.all_token_ids)

    # ---- update after the model ran ------------------------------------------------------

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Apply a step's results to its requests and the KV cache; what changed, per request."""
        outputs = [EngineCoreOutput(r.request_id, finish_reason=r.finish_reason, stop_reason=r.stop_reason)
                   for r in scheduler_output.finished]
        if scheduler_output.is_empty:
            return outputs
        self._account(scheduler_output)
        for s, result in zip(scheduler_output.scheduled, runner_output.results, strict=True):
            outputs.append(self._update_request(s, result))
        return outputs

    def _account(self, scheduler_output: SchedulerOutput) -> None:
        st = self.stats
        st.num_steps += 1
        st.num_prefill_tokens += sum(s.num_tokens for s in scheduler_output.scheduled if not s.is_decode)
        st.peak_blocks_used = max(st.peak_blocks_used, self.kv.num_used_blocks)

    def _update_request(self, s: ScheduledRequest, result: StepResult) -> EngineCoreOutput:
        request = s.request
        rid = request.request_id
        # Rejected drafts do not count as computed; their slots are rolled back.
        request.num_computed_tokens = s.start + s.num_known_tokens + result.num_accepted
        if s.spec_token_ids:
            self.spec_stats.record(len(s.spec_token_ids), result.num_accepted)
            request.metrics.spec_decode.record(len(s.spec_token_ids), result.num_accepted)
            self.kv.trim(rid, request.num_computed_tokens)
            self.runner_record.trimmed(rid, self.kv.table_length(rid))
        tokens = request.all_token_ids
        if result.num_accepted:     # computed now, appended below
            tokens = tokens + s.spec_token_ids[:result.num_accepted]
        self.kv.cache_full_blocks(rid, tokens, request.num_computed_tokens)
        request.metrics.num_kv_blocks = max(request.metrics.num_kv_blocks, self.kv.num_blocks_of(rid))
        self.kv.release_out_of_window(rid, request.num_computed_tokens)
        if result.prompt_logprobs:
            request.num_prompt_logprobs += len(result.prompt_logprobs)
        if result.pooled is not None:       # a pooling request's prompt is done: it ends, its blocks freed
            self._finish(request, "stop")
            return EngineCoreOutput(rid, finish_reason="stop", pooled=result.pooled)
        # Tokens in order (accepted drafts, then the target's own); a stop ends the rest.
        new_tokens: list[int] = []
        on_token = False     # ended by an EOS or stop token (whose text is not output)
        for token in result.token_ids:
            request.append_token(token)
            new_tokens.append(token)
            stop = check_stop(request, token)
            on_token = stop is not None and stop[0] == "stop"
            if not on_token and request.grammar is not None:   # a complete grammar says stop, not length
                stop = _advance_grammar(request, token) or stop
            if stop is not None:
                self._finish(request, *stop)
                break
        return EngineCoreOutput(rid, new_tokens,
                                result.logprobs[:len(new_tokens)] if result.logprobs else None,
                                result.prompt_logprobs, request.finish_reason, request.stop_reason,
                                stopped_on_token=on_token, kv_transfer_params=request.kv_transfer_params)

    # ---- finishing, drafts, the cache's figures ------------------------------------------

    def finish_requests(self, request_ids: Iterable[str], finish_reason: str,
                        stop_reason: int | str | None = None) -> list[Request]:
        """End these requests wherever they are (aborts, stop strings) and free their blocks;
        returns those that were still unfinished."""
        ended = []
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is not None:
                self._finish(request, finish_reason, stop_reason)
                ended.append(request)
        return ended

    def _finish(self, request: Request, reason: str, stop_reason: int | str | None = None) -> None:
        request.finish_reason, request.stop_reason = reason, stop_reason
        request.clear_draft()
        rid = request.request_id
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        elif self.loading.pop(rid, None) is not None:
            self.connector.cancel_load(rid)
        if request.remote_prefill is not None:
            self.connector.forget(rid)
        if self._holds_for_remote_decode(request, reason, stop_reason):
            request.kv_transfer_params = self.connector.request_finished(
                rid, request.prompt_token_ids, self.kv.block_ids(rid))
            self.sending[rid] = request
        else:
            self.kv.free(rid)
        request.status = RequestStatus.FINISHED
        self.requests.pop(request.request_id, None)
        self._released.append(request.request_id)
        self.runner_record.forget(rid)

    def _holds_for_remote_decode(self, request: Request, reason: str, stop_reason) -> bool:
        """A producer's request that finished in its own step (not aborted, not cut by a stop
        string after the step) keeps its blocks for the consumer named by its output."""
        return (request.remote_decode and reason in ("stop", "length") and not isinstance(stop_reason, str)
                and self.kv.num_blocks_of(request.request_id) > 0)

    def take_released(self) -> list[str]:
        """Requests finished or preempted since the last call: state kept for them elsewhere (a
        draft model's cache) can go."""
        released, self._released = self._released, []
        return released

    def draft_candidates(self, k: int) -> list[tuple[Request, int]]:
        """Requests whose next step is a decode, with how many drafts each may take (up to k and
        never past its length limit)."""
        out = []
        for request in self.running:
            room = request.max_total_tokens - request.num_tokens - 1
            if (request.num_tokens_to_compute == 1 and request.output_token_ids
                    and not request.spec_token_ids and room > 0):
                out.append((request, min(k, room)))
        return out

    def update_draft_token_ids(self, requests: list[Request],
                               drafts: list[tuple[list[int], torch.Tensor | None]]) -> None:
        """The proposer's drafts ride on the requests to the next step, which verifies them. A
        constrained request keeps the drafts its grammar accepts and the first one it refuses
        (Grammar.drafts_to_verify): the rest could never be kept."""
        for request, (tokens, probs) in zip(requests, drafts, strict=True):
            if request.grammar is not None:
                keep = request.grammar.drafts_to_verify(tokens)
                tokens, probs = tokens[:keep], None if probs is None else probs[:keep]
            request.spec_token_ids, request.spec_draft_probs = tokens, probs

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of KV blocks held by requests (cached-but-evictable blocks count as free)."""
        return self.kv.usage

    def kv_stats(self) -> dict:
        kv, pc = self.kv, self.kv.prefix_stats
        return {"num_blocks": kv.num_blocks, "blocks_in_use": kv.num_used_blocks,
                "prefix_cache_queries": pc.queries, "prefix_cache_hits": pc.hits,
                "prefix_cache_hit_rate": pc.hit_rate, "prefix_cache_blocks": kv.num_cached_blocks,
                "prefix_cache_evictions": kv.num_evictions}

    def reset_prefix_cache(self) -> None:
        self.kv.reset_prefix_cache()


def _advance_grammar(request: Request, token: int) -> tuple[str, int | str | None] | None:
    """Feed a kept token to the request's grammar; the request ends when the grammar is complete
    (nothing but EOS could follow), or, as a safeguard, when the grammar refuses the token."""
    if not request.grammar.accept(token):
        logger.warning("request %s: token %d breaks its structured-output grammar; ending it",
                       request.request_id, token)
        return "abort", "grammar"
    if request.grammar.is_terminated:
        return "stop", None
    return None


def _rank(request: Request) -> tuple[int, int]:
    return request.priority, request.arrival_index
