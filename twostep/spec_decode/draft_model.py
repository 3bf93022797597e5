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

from twostep.config import DTYPES
from twostep.core.model_runner import ModelRunner
from twostep.core.request import Request
from twostep.core.sampler import Sampler, SamplingRow
from twostep.core.scheduler import ScheduledRequest
from twostep.kv.cache_tensors import KVCachePlan, allocate_kv_cache
from twostep.kv.kv_cache_manager import KVCacheManager
from twostep.layers.attention import get_attention_backend
from twostep.layers.kv_storage import kv_format
from twostep.models.cpu_kernels import apply_cpu_kernels
from twostep.models.loader import build_model, load_checkpoint, resolve_model_path
from twostep.spec_decode.config import SpeculativeConfig
from twostep.spec_decode.rejection import draft_sample

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class TargetShape:
    """What the draft must match or mirror of the target engine."""

    dtype: torch.dtype
    device: torch.device
    vocab_size: int
    max_model_len: int
    block_size: int
    num_blocks: int                  # the draft's pool gets as many blocks as the target's
    max_num_batched_tokens: int = 2048   # the most unseen tokens the draft computes in a step
    attention_backend: str = "auto"
    prepack: bool = True
    gemv: bool = True


@dataclass(slots=True)
class _Fed:
    base: int                        # the request's tokens [0, base) are in the draft's cache,
    drafts: list[int]                # then these drafts, fed back last time


class DraftModelProposer:
    def __init__(self, config: SpeculativeConfig, target: TargetShape, sampler: Sampler) -> None:
        dtype = target.dtype if config.dtype == "auto" else DTYPES[config.dtype]
        path = resolve_model_path(config.model)
        ckpt = load_checkpoint(path, dtype)
        mc = ckpt.config
        if mc.vocab_size != target.vocab_size:
            raise ValueError(f"draft model {path} has a vocabulary of {mc.vocab_size} tokens, the target "
                             f"{target.vocab_size}: a draft must share the target's tokenizer")
        self.max_model_len = min(target.max_model_len, mc.max_position_embeddings)
        model = build_model(ckpt, dtype, target.device, self.max_model_len)
        del ckpt
        apply_cpu_kernels(model, dtype, target.device, target.prepack, target.gemv)
        per_token = kv_format("auto").bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim, dtype)
        plan = KVCachePlan(target.num_blocks, target.block_size, per_token,
                           kv_dtype=str(dtype).removeprefix("torch."))
        caches = allocate_kv_cache(plan, mc.num_layers, mc.num_kv_heads, mc.head_dim, dtype, target.device)
        self.kv = KVCacheManager(plan.num_blocks, plan.block_size, enable_prefix_caching=False)
        self.runner = ModelRunner(model, caches, plan.block_size,
                                  get_attention_backend(target.attention_backend, target.device), target.device, sampler)
        self.sampler = sampler
        self.token_budget = target.max_num_batched_tokens
        self._fed: dict[str, _Fed] = {}
        logger.info("draft model %s: %d layers, dtype %s; its %s", path, mc.num_layers,
                    str(dtype).removeprefix("torch."), plan.describe())

    def propose(self, requests: list[Request], ks: list[int]
                ) -> list[tuple[list[int], torch.Tensor | None]]:
        """Up to ks[i] drafts for requests[i], with the distributions they were drawn from
        ([k, V], or None when every draft was a greedy argmax)."""
        active, chunks = self._select(requests, ks)
        drafts: dict[str, list[int]] = {r.request_id: [] for r, _ in active}
        dists: dict[str, list[torch.Tensor | None]] = {r.request_id: [] for r, _ in active}
        # Step 0 catches up on unseen tokens; step j > 0 feeds draft j back in.
        items = [ScheduledRequest(r, r.num_tokens - self._fed[r.request_id].base,
                                  self._fed[r.request_id].base) for r, _ in active]
        while items or chunks:
            logits = self.runner.last_logits(items + chunks, self.kv)[:len(items)]
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
            items = [ScheduledRequest(r, 1, r.num_tokens + len(drafts[r.request_id]) - 1,
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
                chunks.append(ScheduledRequest(request, unseen, base))
                self._fed[request.request_id] = _Fed(base + unseen, [])
            budget -= unseen
        return active, chunks

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
        # The cache will hold the request's tokens and drafts 1 .. k-1.
        if not self.kv.allocate_slots(rid, valid, request.num_tokens + k - 1 - valid):
            self.remove(rid)
            return False
        # Blocks reserved for drafts 2..k are read (masked) by batched steps before they are
        # written: zero them now, as garbage there could be NaN (and NaN * 0 is NaN).
        self.runner.ensure_zeroed(self.kv.block_ids(rid))
        self._fed[rid] = _Fed(valid, [])
        return True

    def remove(self, request_id: str) -> None:
        self.kv.free(request_id)
        self._fed.pop(request_id, None)


def _stack(dists: list[torch.Tensor | None]) -> torch.Tensor | None:
    return None if any(d is None for d in dists) else torch.stack(dists)
