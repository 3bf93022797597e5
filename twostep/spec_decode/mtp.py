"""Drafts from the target checkpoint's own multi-token-prediction layer (Qwen3.5, Qwen3.5-MoE,
Qwen3-Next: models/mtp.py), vLLM's "mtp" method.

The MTP layer's row p combines the target's final hidden state at p with the token at p + 1 and
predicts the token at p + 2; it attends over its own K/V of rows 0..p (one layer's paged cache,
kept here: a block table per request, as the draft model's). So the proposer needs the target's
hidden state of every position the target computes: the engine hands it each step's
(`observe`, from StepResult.hidden: prompt chunks, decodes, a verification's known token and
accepted drafts), and the MTP layer runs over those rows in the same step, the token after each row
known by then (the prompt's next token, or what the step sampled). Its cache thus holds rows
0 .. n-1 of a request whose n tokens the target computed, and the last row's output predicts the
token after the newest one: the first draft. Draft j > 1 runs one more row, feeding the previous
row's output (after the layer's final norm) and draft j - 1, k - 1 one-row steps batched over
the proposing requests. Those rows are the drafts' own: the next observe rolls the table back to
the rows made from the target's hidden states and overwrites them (an accepted draft's row is
recomputed from the target's hidden state, as in vLLM).

Prefix caching: the target skips the cached prompt blocks, so their hidden states never come. The
MTP cache keeps its own prefix cache: block b's rows depend on the tokens up to the first of block
b + 1, so its key chains the tokens shifted by one (the first token as the chain's extra). A
request whose target hit is not a hit here too (evicted since) gets no drafts: its rows cannot be
made (lossless either way; it decodes without speculation).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from twostep.attention.kv_layer_cache import block_fills
from twostep.attention.metadata import AttentionMetadata, int64_tensor
from twostep.config import EngineConfig, SpeculativeConfig
from twostep.core.execution.model_builder import ModelInstance
from twostep.core.scheduling.request import Request
from twostep.core.scheduling.scheduler_output import ScheduledRequest
from twostep.core.step_outputs import StepResult
from twostep.kv.block_hash import chain_keys
from twostep.kv.block_pool import NULL_BLOCK_ID
from twostep.kv.cache_tensors import KVCachePlan, KVGroupPlan, allocate_kv_cache
from twostep.kv.kv_cache_manager import KVCacheManager
from twostep.layers.dispatch import apply_platform
from twostep.models.mtp import load_mtp
from twostep.platforms import Platform
from twostep.platforms.step_kind import decode_batch
from twostep.sample.rejection_sampler import draft_sample
from twostep.sample.sampler import Sampler, SamplingRow

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Seq:
    rows: int = 0                        # rows [0, rows) of its table: made from the target's hidden states
    last: torch.Tensor | None = None     # the layer's output at row rows - 1 [H]: the first draft's input
    blind: bool = False                  # rows it can never have (a prefix hit missed here): no drafts


@dataclass(slots=True)
class _Rows:
    """One request's rows in an MTP forward."""

    request_id: str
    start: int                           # the first row's position
    token_ids: list[int]                 # the token after each row (its embedding is the input)
    hidden: torch.Tensor                 # [n, H]: the target's hidden states, or the layer's own output
    decode: bool                         # decode-shaped (one row, or a verification's few)


class MTPProposer:
    def __init__(self, config: SpeculativeConfig, engine: EngineConfig, target: ModelInstance,
                 platform: Platform, sampler: Sampler) -> None:
        if engine.tensor_parallel_size > 1:
            raise ValueError('speculative method "mtp" does not run under tensor parallelism yet')
        self.target = target.model
        self.mtp = load_mtp(target.path, target.config, target.dtype, target.device)
        for line in apply_platform(self.mtp, platform, target.dtype):
            logger.info("MTP layer: %s", line)
        self.dtype, self.device = target.dtype, target.device
        self.sampler = sampler
        self.backend = target.runner.backend
        # One layer's K/V in the target's format, as many blocks as the target's (full-attention) pool.
        cfg, fmt, block_size = self.mtp.config, target.runner.kv_caches[0].fmt, engine.block_size
        num_blocks = target.kv_plan.num_blocks
        plan = KVCachePlan(block_size, (KVGroupPlan(1, fmt.bytes_per_token(1, cfg.num_kv_heads, cfg.head_dim,
                                                                           self.dtype), num_blocks),))
        [self.cache] = allocate_kv_cache(plan, 1, cfg.num_kv_heads, cfg.head_dim, self.dtype, self.device, fmt)
        self.kv = KVCacheManager(num_blocks, block_size, engine.enable_prefix_caching)
        self.block_size = block_size
        self._fills = block_fills([self.cache])
        self._zeroed = bytearray(num_blocks + 1)      # as the runner's: a block is zeroed on first use
        self._ensure_zeroed([NULL_BLOCK_ID])
        self._seqs: dict[str, _Seq] = {}
        self.num_blind = 0          # requests that got no drafts: rows the layer could not make
        logger.info("MTP layer of %s (%s MLP): its KV cache %d blocks x %d tokens, %.1f MiB", target.path,
                    "MoE" if cfg.is_moe_layer(0) else "dense", num_blocks, block_size, plan.total_bytes / 2**20)

    # ---- every step: the target's hidden states in, the layer's rows out ------------------------

    @torch.inference_mode()
    def observe(self, scheduled: list[ScheduledRequest], results: list[StepResult]) -> None:
        """Run the MTP layer over the rows the target just computed and kept, for every request
        still running; each request's last row's output is its next first draft's input."""
        batch: list[_Rows] = []
        requests: list[Request] = []
        for s, result in zip(scheduled, results, strict=True):
            request = s.request
            if result.hidden is None or not len(result.hidden) or request.is_finished:
                continue
            rid, n = request.request_id, len(result.hidden)
            seq = self._seqs.get(rid) or self._start(request, s.start)
            if seq.blind:
                continue
            tokens = request.all_token_ids[s.start + 1:s.start + n + 1]
            # every step of a request is observed, so its rows continue where the last ones ended
            if s.start != seq.rows or len(tokens) != n:
                self._blind(rid, f"rows from {seq.rows}, the step's from {s.start}")
                continue
            self.kv.trim(rid, seq.rows)           # the last proposal's draft rows
            if not self.kv.allocate_slots(rid, seq.rows, n):
                self._blind(rid, "its cache is full")
                continue
            batch.append(_Rows(rid, s.start, tokens, result.hidden, s.is_decode))
            requests.append(request)
        if not batch:
            return
        out = self._forward(batch)
        end = 0
        for rows, request in zip(batch, requests):
            end += len(rows.token_ids)
            seq = self._seqs[rows.request_id]
            seq.rows += len(rows.token_ids)
            seq.last = out[end - 1].clone()
            # its full blocks of rows made from the target's hidden states, to the prefix cache
            tokens = request.all_token_ids
            self.kv.cache_full_blocks(rows.request_id, tokens[1:], seq.rows, tokens[0])

    def _start(self, request: Request, start: int) -> _Seq:
        """A request the layer has not seen: from row 0, or from a prefix hit of the target's,
        which needs the same hit here (rows of cached blocks, keyed by the tokens shifted by one)."""
        seq = self._seqs[request.request_id] = _Seq()
        if start == 0:
            return seq
        tokens, bs = request.all_token_ids, self.block_size
        if self.kv.enable_prefix_caching and start % bs == 0:
            hits = self.kv.groups[0].lookup(chain_keys(tokens[1:start + 1], bs, [], tokens[0]))
            if all(b is not None for b in hits) and self.kv.allocate_slots(request.request_id, 0, start, [hits]):
                seq.rows = start
                return seq
        self._blind(request.request_id, f"its first {start} tokens came from the target's prefix cache, not its own")
        return seq

    def _blind(self, request_id: str, why: str) -> None:
        logger.debug("MTP: no drafts for %s: %s", request_id, why)
        self.num_blind += 1
        self.kv.free(request_id)
        self._seqs[request_id] = _Seq(blind=True)

    # ---- drafts ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def propose(self, requests: list[Request], ks: list[int]
                ) -> list[tuple[list[int], torch.Tensor | None]]:
        """Up to ks[i] drafts for requests[i], with the distributions they were drawn from ([k, V],
        or None when every draft was a greedy argmax)."""
        active: list[tuple[Request, int]] = []
        for request, k in zip(requests, ks):
            rid = request.request_id
            seq = self._seqs.get(rid)
            if seq is None or seq.blind or seq.last is None or seq.rows != request.num_tokens - 1:
                continue
            self.kv.trim(rid, seq.rows)
            if k > 1 and not self.kv.allocate_slots(rid, seq.rows, k - 1):   # rows of drafts 1 .. k-1
                k = 1
            active.append((request, k))
        if not active:
            return [([], None) for _ in requests]
        drafts: dict[str, list[int]] = {r.request_id: [] for r, _ in active}
        dists: dict[str, list[torch.Tensor | None]] = {r.request_id: [] for r, _ in active}
        live = active
        hidden = torch.stack([self._seqs[r.request_id].last for r, _ in live])
        while True:
            with decode_batch(True):
                logits = self.target.compute_logits(hidden)
            rows = [SamplingRow(r.params, r.prompt_token_ids, r.output_token_ids + drafts[r.request_id], r.generator)
                    for r, _ in live]
            tokens, probs = draft_sample(self.sampler, logits, rows)
            for (r, _), token, p in zip(live, tokens, probs):
                drafts[r.request_id].append(token)
                dists[r.request_id].append(p)
            keep = [i for i, (r, k) in enumerate(live) if len(drafts[r.request_id]) < k]
            if not keep:
                break
            live = [live[i] for i in keep]
            # draft j's row: at the newest token's position + j - 1, the layer's last output and draft j
            hidden = self._forward([_Rows(r.request_id, r.num_tokens - 2 + len(drafts[r.request_id]),
                                          drafts[r.request_id][-1:], hidden[i:i + 1], True)
                                    for i, (r, _) in zip(keep, live)])
        by_id = {rid: (drafts[rid], _stack(dists[rid])) for rid in drafts}
        return [by_id.get(r.request_id, ([], None)) for r in requests]

    # ---- one forward of the layer ------------------------------------------------------------

    def _forward(self, batch: list[_Rows]) -> torch.Tensor:
        """The layer over every request's rows at once (one flat batch, as the runner's), writing
        their K/V to the requests' blocks; its output [rows, H]."""
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts, qlens, slens, tables = [0], [], [], []
        for rows in batch:
            n, table = len(rows.token_ids), self.kv.block_ids(rows.request_id)
            span = range(rows.start, rows.start + n)
            ids.extend(rows.token_ids)
            positions.extend(span)
            slots.extend(table[p // bs] * bs + p % bs for p in span)
            starts.append(starts[-1] + n)
            qlens.append(n)
            slens.append(rows.start + n)
            tables.append(table)
        width = max(len(t) for t in tables)
        self._ensure_zeroed([b for t in tables for b in t])
        meta = AttentionMetadata(
            query_start_loc=starts, query_lens=qlens, seq_lens=slens,
            slot_mapping=int64_tensor(slots, self.device),
            block_tables=int64_tensor([b for t in tables for b in t + [NULL_BLOCK_ID] * (width - len(t))],
                                      self.device).view(len(tables), width),
            block_size=bs, is_decode=[rows.decode for rows in batch])
        input_ids, pos = int64_tensor(ids, self.device), int64_tensor(positions, self.device)
        hidden = batch[0].hidden if len(batch) == 1 else torch.cat([rows.hidden for rows in batch])
        with decode_batch(all(rows.decode for rows in batch)):
            embeds = self.target.embed(input_ids)
            ropes = {kind: rotary.lookup(pos, embeds.dtype) for kind, rotary in self.target.rotary.items()}
            return self.mtp(embeds, hidden, ropes, self.cache, self.backend.build_metadata(meta), self.backend)

    def _ensure_zeroed(self, block_ids: list[int]) -> None:
        """Zero the blocks never written yet: attention reads a table's unwritten slots (masked),
        and garbage there could be NaN (NaN * 0 is NaN)."""
        fresh = sorted({b for b in block_ids if not self._zeroed[b]})
        if not fresh:
            return
        index = int64_tensor(fresh, self.device)
        for tensor, dim in self._fills:
            tensor.index_fill_(dim, index, 0)
        for b in fresh:
            self._zeroed[b] = 1

    def remove(self, request_id: str) -> None:
        self.kv.free(request_id)
        self._seqs.pop(request_id, None)


def _stack(dists: list[torch.Tensor | None]) -> torch.Tensor | None:
    return None if any(d is None for d in dists) else torch.stack(dists)
