"""Turns a SchedulerOutput into one flat, unpadded forward pass and samples from it.

Inputs per step: input_ids and positions of every scheduled token, slot_mapping (where each
new token's K/V goes), block tables and lengths for attention. lm_head runs only on the
rows that need logits: the last token of each request that samples this step, every position
of a request verifying drafts, plus prompt positions of requests that asked for prompt_logprobs.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from twostep.core.sampler import Sampler, SamplingRow, prompt_logprobs
from twostep.core.scheduler import ScheduledRequest, SchedulerOutput
from twostep.kv.kv_cache_manager import KVCacheManager
from twostep.layers.attention import AttentionBackend, AttentionMetadata, DecodeBatch
from twostep.layers.kv_storage import KVLayerCache
from twostep.models.decoder import DecoderForCausalLM
from twostep.outputs import PositionLogprobs
from twostep.spec_decode.rejection import DraftRow, RejectionSampler


@dataclass(slots=True)
class StepResult:
    """What one step produced for one scheduled request."""

    scheduled: ScheduledRequest
    token_ids: list[int] = field(default_factory=list)   # none for a prefill chunk that samples nothing
    logprobs: list[PositionLogprobs | None] | None = None  # one per token when asked for
    prompt_logprobs: list[PositionLogprobs] | None = None
    num_accepted: int = 0                        # drafts the target accepted (the rest rolled back)

    @property
    def num_computed_tokens(self) -> int:
        """The request's tokens in the KV cache after this step: rejected drafts do not count."""
        s = self.scheduled
        return s.start + s.num_known_tokens + self.num_accepted


@dataclass(slots=True)
class _LogitRows:
    sample_index: dict[int, int]                 # scheduled position -> row in logits
    verify_rows: dict[int, int]                  # scheduled position -> first of its k + 1 rows
    prompt_rows: dict[int, tuple[int, int, int]] # scheduled position -> (first row, count, first target pos)
    flat_indices: list[int]


class ModelRunner:
    def __init__(self, model: DecoderForCausalLM, kv_caches: list[KVLayerCache], block_size: int,
                 backend: AttentionBackend, device: torch.device, sampler: Sampler) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.backend = backend
        self.device = device
        self.sampler = sampler
        self.rejection_sampler = RejectionSampler(sampler)
        # The cache is allocated uninitialised (fast start, no memory until used). A block is
        # zeroed the first time it is written, so the positions attention reads as padding
        # are finite and masking them is enough (garbage could be NaN, and NaN * 0 is NaN).
        self._zeroed = torch.zeros(kv_caches[0].num_blocks, dtype=torch.bool)
        self.ensure_zeroed([0])          # padding entries of block tables point at block 0

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, kv: KVCacheManager) -> list[StepResult]:
        items = sched.scheduled
        input_ids, positions, meta = self._prepare(items, kv)
        hidden = self.model(input_ids, positions, self.kv_caches, meta, self.backend)
        rows = self._logit_rows(items, meta)
        if not rows.flat_indices:
            return [StepResult(s) for s in items]
        logits = self.model.compute_logits(hidden[torch.tensor(rows.flat_indices, device=self.device)])
        return self._results(items, logits, rows)

    @torch.inference_mode()
    def all_logits(self, sched: SchedulerOutput, kv: KVCacheManager) -> torch.Tensor:
        """Logits at every scheduled position (flat, [T, vocab]); for checks against a reference.
        Writes K/V like a normal step but samples nothing."""
        input_ids, positions, meta = self._prepare(sched.scheduled, kv)
        hidden = self.model(input_ids, positions, self.kv_caches, meta, self.backend)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def last_logits(self, items: list[ScheduledRequest], kv: KVCacheManager) -> torch.Tensor:
        """Logits [len(items), vocab] at each item's last position (a draft model's proposals)."""
        input_ids, positions, meta = self._prepare(items, kv)
        hidden = self.model(input_ids, positions, self.kv_caches, meta, self.backend)
        last = torch.tensor(meta.query_start_loc[1:], device=self.device) - 1
        return self.model.compute_logits(hidden[last])

    def ensure_zeroed(self, block_ids: list[int]) -> None:
        """Zero those of these blocks that were never written (see __init__)."""
        fresh = [b for b in block_ids if not self._zeroed[b]]
        if not fresh:
            return
        index = torch.tensor(fresh, device=self.device)
        for cache in self.kv_caches:
            cache.zero_blocks(index)
        self._zeroed[fresh] = True

    def _prepare(self, items: list[ScheduledRequest], kv: KVCacheManager):
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        starts, qlens, slens, tables = [0], [], [], []
        bs = self.block_size
        for s in items:
            req, end = s.request, s.start + s.num_tokens
            block_ids = kv.block_ids(req.request_id)
            ids.extend(s.input_token_ids())
            pos.extend(range(s.start, end))
            slots.extend(block_ids[p // bs] * bs + p % bs for p in range(s.start, end))
            starts.append(starts[-1] + s.num_tokens)
            qlens.append(s.num_tokens)
            slens.append(end)
            tables.append(block_ids)
        self.ensure_zeroed(sorted({sl // bs for sl in slots}))
        width = max(len(t) for t in tables)
        table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64,
                             device=self.device)
        # Decodes, and decodes verifying drafts, share one batched attention call per layer.
        decode_rows = [i for i, s in enumerate(items) if s.num_tokens == 1 or s.spec_token_ids]
        decode_set = set(decode_rows)
        meta = AttentionMetadata(
            query_start_loc=starts, query_lens=qlens, seq_lens=slens,
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=self.device),
            block_tables=table, block_size=bs,
            prefill_rows=[i for i in range(len(items)) if i not in decode_set],
            decode=DecodeBatch.build(decode_rows, starts, qlens, slens, table, bs) if decode_rows else None,
        )
        to_dev = lambda x: torch.tensor(x, dtype=torch.int64, device=self.device)  # noqa: E731
        return to_dev(ids), to_dev(pos), meta

    def _logit_rows(self, items: list[ScheduledRequest], meta: AttentionMetadata) -> _LogitRows:
        rows = _LogitRows({}, {}, {}, [])
        for i, s in enumerate(items):
            req, first = s.request, meta.query_start_loc[i]
            if req.wants_prompt_logprobs:
                # Logits at prompt position p score prompt token p + 1.
                lo = max(s.start, len(req.prompt_logprobs) - 1)
                hi = min(s.start + s.num_tokens, req.num_prompt_tokens - 1)
                if hi > lo:
                    rows.prompt_rows[i] = (len(rows.flat_indices), hi - lo, lo + 1)
                    rows.flat_indices.extend(first + p - s.start for p in range(lo, hi))
            if s.spec_token_ids:
                rows.verify_rows[i] = len(rows.flat_indices)
                rows.flat_indices.extend(range(first, first + s.num_tokens))
            elif s.completes_known_tokens:
                rows.sample_index[i] = len(rows.flat_indices)
                rows.flat_indices.append(first + s.num_tokens - 1)
        return rows

    def _results(self, items, logits: torch.Tensor, rows: _LogitRows) -> list[StepResult]:
        results = [StepResult(s) for s in items]
        for i, (row, count, target) in rows.prompt_rows.items():
            req = items[i].request
            targets = req.prompt_token_ids[target:target + count]
            results[i].prompt_logprobs = prompt_logprobs(
                logits[row:row + count], targets, req.params.prompt_logprobs)
        sampling = list(rows.sample_index.items())
        if sampling:
            sample_rows = [
                SamplingRow(items[i].request.params, items[i].request.prompt_token_ids,
                            items[i].request.output_token_ids, items[i].request.generator)
                for i, _ in sampling
            ]
            picked = logits[torch.tensor([r for _, r in sampling], device=logits.device)]
            out = self.sampler(picked, sample_rows)
            for k, (i, _) in enumerate(sampling):
                results[i].token_ids = [out.token_ids[k]]
                results[i].logprobs = [out.logprobs[k]]
        if rows.verify_rows:
            self._verify(items, logits, rows.verify_rows, results)
        return results

    def _verify(self, items, logits: torch.Tensor, verify_rows: dict[int, int],
                results: list[StepResult]) -> None:
        drafts, picked = [], []
        for i, row in verify_rows.items():
            s, req = items[i], items[i].request
            drafts.append(DraftRow(
                SamplingRow(req.params, req.prompt_token_ids, req.output_token_ids, req.generator),
                s.spec_token_ids, s.spec_draft_probs))
            picked.extend(range(row, row + s.num_tokens))
        verified = self.rejection_sampler(logits[torch.tensor(picked, device=logits.device)], drafts)
        for i, v in zip(verify_rows, verified):
            results[i].token_ids, results[i].num_accepted = v.token_ids, v.num_accepted
            results[i].logprobs = v.logprobs
