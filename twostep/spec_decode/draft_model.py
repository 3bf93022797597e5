"""A draft model proposes k tokens by running k cheap decode steps with its own paged KV cache.

The draft (a smaller model with the target's vocabulary, or the target itself in a cheaper
dtype) keeps, per request, the tokens its cache holds: the request's tokens up to some point,
then the drafts it fed itself last time. Before proposing it keeps the longest prefix that
the target confirmed (accepted drafts stay, rejected ones roll back), catches up on the
tokens it has not seen in one forward (the 1-2 tokens a verification step added, or a prompt
after prefill, in chunks of at most max_num_batched_tokens a step), then feeds each new draft
back in, k - 1 more one-token steps, batched over every proposing request.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from twostep.config import DTYPES, EngineConfig, SpeculativeConfig
from twostep.core.execution.model_builder import CacheSpec, ModelInstance, ModelSpec, build_model_instance
from twostep.core.scheduling.runner_record import RunnerRecord
from twostep.core.scheduling.scheduler_output import ScheduledRequest
from twostep.core.scheduling.request import Request
from twostep.models.loader import resolve_model_path
from twostep.platforms import Platform
from twostep.sample.rejection_sampler import draft_sample
from twostep.sample.sampler import Sampler, SamplingRow

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Fed:
    base: int                        # the request's tokens [0, base) are in the draft's cache,
    drafts: list[int]                # then these drafts, fed back last time


class DraftModelProposer:
    def __init__(self, config: SpeculativeConfig, engine: EngineConfig, target: ModelInstance,
                 platform: Platform, sampler: Sampler) -> None:
        dtype = target.dtype if config.dtype == "auto" else DTYPES[config.dtype]
        # As many blocks as the target's pool, in the draft's own shape; no prefix caching.
        draft = build_model_instance(
            ModelSpec(resolve_model_path(config.model), dtype, platform, target.max_model_len,
                      cap_max_model_len=True, attention_backend=engine.attention_backend,
                      vocab_size=target.config.vocab_size),
            CacheSpec(engine.block_size, "auto", False, num_blocks=target.kv_plan.num_blocks),
            sampler)
        if draft.config.linear_layers:
            raise ValueError(f"draft model {draft.path}: a model with linear-attention layers (Qwen3.5, Qwen3-Next) "
                             "cannot be the draft yet (its state does not roll back to the verified prefix); "
                             "use a model with attention only, or n-gram speculation")
        self.max_model_len = draft.max_model_len
        self.kv, self.runner = draft.kv_manager, draft.runner
        self.sampler = sampler
        self.token_budget = engine.max_num_batched_tokens
        self._fed: dict[str, _Fed] = {}
        self._record = RunnerRecord(samples=False)   # what the draft's runner holds (it samples nothing)
        logger.info("draft model %s: %d layers, dtype %s; its %s", draft.path, draft.config.num_layers,
                    str(dtype).removeprefix("torch."), draft.kv_plan.describe())

    def propose(self, requests: list[Request], ks: list[int]
                ) -> list[tuple[list[int], torch.Tensor | None]]:
        """Up to ks[i] drafts for requests[i], with the distributions they were drawn from
        ([k, V], or None when every draft was a greedy argmax)."""
        active, chunks = self._select(requests, ks)
        drafts: dict[str, list[int]] = {r.request_id: [] for r, _ in active}
        dists: dict[str, list[torch.Tensor | None]] = {r.request_id: [] for r, _ in active}
        # Step 0 catches up on unseen tokens; step j > 0 feeds draft j back in.
        items = [self._item(r, r.num_tokens - self._fed[r.request_id].base,
                            self._fed[r.request_id].base) for r, _ in active]
        while items or chunks:
            logits = self.runner.last_logits(self._record.plan(items + chunks))[:len(items)]
            chunks = []                  # catch-up chunks only ride along in the first forward
            if not items:
                break
            rows = [SamplingRow(s.request.params, s.request.prompt_token_ids,
                                s.request.output_token_ids + drafts[s.request.request_id],
                                s.request.generator) for s in items]
            tokens, probs = draft_sample(self.sampler, logits, rows)
            for s, token, p in zip(items, tokens, probs):
                drafts[s.request.request_id].append(token)
                dists[s.request.request_id].append(p)
            items = [self._item(r, 1, r.num_tokens + len(drafts[r.request_id]) - 1,
                                list(drafts[r.request_id]))
                     for r, k in active if len(drafts[r.request_id]) < k]
        for r, k in active:
            self._fed[r.request_id] = _Fed(r.num_tokens, drafts[r.request_id][:k - 1])
        by_id = {r.request_id: (drafts[r.request_id], _stack(dists[r.request_id])) for r, _ in active}
        return [by_id.get(r.request_id, ([], None)) for r in requests]

    def _select(self, requests: list[Request], ks: list[int]
                ) -> tuple[list[tuple[Request, int]], list[ScheduledRequest]]:
        """The requests that propose now (with their k), and chunks of those still catching up:
        like the target, the draft computes at most max_num_batched_tokens unseen tokens a step
        (a long prompt that just finished its prefill is caught up over several steps)."""
        active, chunks, budget = [], [], self.token_budget
        for request, k in zip(requests, ks):
            k = min(k, self.max_model_len - request.num_tokens + 1)
            if k < 1:                        # past the draft's context: it will not propose again
                self.remove(request.request_id)
                continue
            if budget == 0 or not self._make_room(request, k):
                continue
            base = self._fed[request.request_id].base
            unseen = request.num_tokens - base
            if unseen <= budget:
                active.append((request, k))
            else:
                unseen = budget
                chunks.append(self._item(request, unseen, base))
                self._fed[request.request_id] = _Fed(base + unseen, [])
            budget -= unseen
        return active, chunks

    def _item(self, request: Request, num_tokens: int, start: int,
              drafts: list[int] | None = None) -> ScheduledRequest:
        """One row of a draft forward, over the draft's own block table."""
        return ScheduledRequest(request, num_tokens, start, drafts or [],
                                tables=self.kv.tables(request.request_id))

    def _make_room(self, request: Request, k: int) -> bool:
        """Roll the draft's cache back to what the target confirmed and grow it for k drafts."""
        rid = request.request_id
        fed = self._fed.get(rid, _Fed(0, []))
        valid = fed.base
        tokens = request.all_token_ids
        for i, token in enumerate(fed.drafts):
            if fed.base + i >= len(tokens) or tokens[fed.base + i] != token:
                break
            valid += 1
        valid = min(valid, request.num_tokens - 1)   # the newest token is always fed
        self.kv.trim(rid, valid)
        self._record.trimmed(rid, self.kv.table_length(rid))
        # The cache will hold the request's tokens and drafts 1 .. k-1.
        if not self.kv.allocate_slots(rid, valid, request.num_tokens + k - 1 - valid):
            self.remove(rid)
            return False
        # Blocks reserved for drafts 2..k are read (masked) by batched steps before they are
        # written: zero them now, as garbage there could be NaN (and NaN * 0 is NaN).
        self.runner.ensure_zeroed(self.kv.tables(rid))
        self._fed[rid] = _Fed(valid, [])
        return True

    def remove(self, request_id: str) -> None:
        self.kv.free(request_id)
        self._fed.pop(request_id, None)
        self._record.forget(request_id)


def _stack(dists: list[torch.Tensor | None]) -> torch.Tensor | None:
    return None if any(d is None for d in dists) else torch.stack(dists)
