"""Turns a StepPlan (core/step_outputs.py: the scheduler's message, plain data) into one flat,
unpadded forward pass and samples from it. The runner keeps its requests' state between steps
(core/execution/request_states.py) and reads nothing of the scheduler's.

Inputs per step: input_ids and positions of every scheduled token, slot_mapping (where each
new token's K/V goes), block tables and lengths for attention: the common metadata, one per
KV-cache group (kv/kv_cache_manager.py), which the attention backend turns into its own once per
step; each layer reads its group's. lm_head runs only on the
rows that need logits: the last token of each request that samples this step, every position
of a request verifying drafts, plus prompt positions of requests that asked for prompt_logprobs.
A pooling request's rows go to the pooler instead (pooler.py), which returns its vector when its
prompt is complete.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from contextlib import AbstractContextManager
from typing import Protocol

import torch

from twostep.attention.backend import AttentionBackend
from twostep.attention.kv_layer_cache import KVLayerCache, block_fills
from twostep.attention.linear_state import LinearStateCache, StateMetadata
from twostep.attention.metadata import AttentionMetadata, int64_tensor
from twostep.core.execution.pooler import Pooler
from twostep.core.execution.request_states import RequestState, RequestStates
from twostep.core.step_outputs import ModelRunnerOutput, RequestStep, StepPlan, StepResult
from twostep.kv.block_pool import NULL_BLOCK_ID
from twostep.kv_transfer.blocks import scatter_blocks
from twostep.models.causal_lm import CausalLM
from twostep.platforms.step_kind import decode_batch
from twostep.sample.rejection_sampler import DraftRow, RejectionSampler
from twostep.sample.sampler import Sampler, SamplingRow, prompt_logprobs


@dataclass(slots=True)
class StepInputs:
    """One forward's inputs, as every tensor-parallel rank runs them."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    metas: list[AttentionMetadata]   # one per KV-cache group
    blocks: list[list[int]]      # each group's blocks written this step (zeroed on first use)
    # every row a generated position: one sequence's next token or a draft it verifies (no prompt
    # rows): the kernels may take a decode batch's faster products (platforms/step_kind.py)
    decode_batch: bool = False
    states: StateMetadata | None = None      # a hybrid model's linear-attention layers' layout
    state_starts: list[tuple[int, int]] = field(default_factory=list)   # (live slot, restore from; 0: zero it)

    @property
    def meta(self) -> AttentionMetadata:
        """The first group's metadata: the layout every group shares (query and sequence lengths)."""
        return self.metas[0]


class StepBroadcast(Protocol):
    """Tensor parallelism (core/execution/tp_group.py): hands a step's plan and which logit rows it
    computes to the other ranks, and turns a failed collective during the step into an error that
    names the rank."""

    def step(self, plan: StepPlan, rows: str) -> AbstractContextManager: ...


@dataclass(slots=True)
class _LogitRows:
    sample_index: dict[int, int]                 # scheduled position -> row in logits
    verify_rows: dict[int, int]                  # scheduled position -> first of its k + 1 rows
    prompt_rows: dict[int, tuple[int, int, int]] # scheduled position -> (first row, count, first target pos)
    flat_indices: list[int]


class ModelRunner:
    def __init__(self, model: CausalLM, layer_caches: list[KVLayerCache | LinearStateCache], block_size: int,
                 backend: AttentionBackend, device: torch.device, sampler: Sampler,
                 states: tuple[torch.Tensor, torch.Tensor] | None = None, pooler: Pooler | None = None) -> None:
        """layer_caches: each layer's K/V, or a linear-attention layer's states (views of `states`:
        every such layer's conv and recurrent states, [layers, slots + 1, ...]). pooler: a pooling
        engine's (its requests' vectors from the hidden states; they sample nothing)."""
        self.model = model
        self.pooler = pooler
        self.layer_caches = layer_caches
        self.kv_caches = [c for c in layer_caches if isinstance(c, KVLayerCache)]
        self.state_caches = [c for c in layer_caches if isinstance(c, LinearStateCache)]
        self.states = states
        kv_caches = self.kv_caches
        self.block_size = block_size
        self.backend = backend
        self.device = device
        self.sampler = sampler
        self.rejection_sampler = RejectionSampler(sampler)
        self.peers: StepBroadcast | None = None      # the other tensor-parallel ranks, if any
        # True: each StepResult carries its rows of the step's final hidden states (StepResult.hidden,
        # views: nothing is copied); a proposer that drafts from them (MTP) asks for it
        self.keep_hidden = False
        # The cache is allocated uninitialised (fast start, no memory until used). A block is
        # zeroed the first time it is written, so the positions attention reads as padding
        # are finite and masking them is enough (garbage could be NaN, and NaN * 0 is NaN).
        # Block tables are padded with the null block, which no request holds: zero it now.
        groups = [[c for c in kv_caches if c.group == g] for g in range(max(c.group for c in kv_caches) + 1)]
        self._zeroed = [bytearray(g[0].num_blocks) for g in groups]   # 1 where a block was zeroed or written
        self._block_fills = [block_fills(g) for g in groups]
        self.ensure_zeroed([[NULL_BLOCK_ID]] * len(groups))
        self.requests = RequestStates()              # the runner's own state of its requests

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> ModelRunnerOutput:
        with self._broadcast(plan, "sample"):
            states = self.requests.apply(plan)
            if not plan.steps:
                return ModelRunnerOutput()
            inputs = self._prepare(plan.steps, states)
            rows = self._logit_rows(plan.steps, states, inputs.meta)
            hidden, logits = self.run_local(inputs, rows.flat_indices or None)
        if logits is None:
            results = [StepResult() for _ in plan.steps]
        else:
            results = self._results(plan.steps, states, logits, rows)
            self._keep_verified_states(plan.steps, results)
            for state, result in zip(states, results):   # what it sampled, and the drafts it accepted
                state.output_token_ids.extend(result.token_ids)
        if self.pooler is not None:
            for i, vector in self.pooler.pool(hidden, plan.steps, states, inputs.meta.query_start_loc).items():
                results[i].pooled = vector
        if self.keep_hidden:
            for first, s, result in zip(inputs.meta.query_start_loc, plan.steps, results):
                result.hidden = hidden[first:first + s.num_known_tokens + result.num_accepted]
        return ModelRunnerOutput(results)

    @torch.inference_mode()
    def all_logits(self, plan: StepPlan) -> torch.Tensor:
        """Logits at every scheduled position (flat, [T, vocab]); for checks against a reference.
        Writes K/V like a normal step but samples nothing."""
        with self._broadcast(plan, "all"):
            inputs = self._prepare(plan.steps, self.requests.apply(plan))
            return self.run_local(inputs, _rows("all", inputs))[1]

    @torch.inference_mode()
    def last_logits(self, plan: StepPlan) -> torch.Tensor:
        """Logits [len(plan.steps), vocab] at each step's last position (a draft model's proposals)."""
        with self._broadcast(plan, "last"):
            inputs = self._prepare(plan.steps, self.requests.apply(plan))
            return self.run_local(inputs, _rows("last", inputs))[1]

    def _broadcast(self, plan: StepPlan, rows: str) -> AbstractContextManager:
        """The plan to the other tensor-parallel ranks first, so that every rank prepares its inputs
        at once; rows: which logit rows the step computes ("sample", "all", "last")."""
        if self.peers is None or not (plan.steps or plan.removed):
            return contextlib.nullcontext()
        return self.peers.step(plan, rows)

    def run_worker(self, plan: StepPlan, rows: str) -> None:
        """A tensor-parallel worker's part of a step: the plan rank 0 sent, applied to this rank's
        own state, and the same forward with the same logit rows."""
        states = self.requests.apply(plan)
        if not plan.steps:
            return
        inputs = self._prepare(plan.steps, states)
        if rows == "sample":
            self.run_local(inputs, self._logit_rows(plan.steps, states, inputs.meta).flat_indices or None)
        else:
            self.run_local(inputs, _rows(rows, inputs))

    def run_local(self, inputs: StepInputs, rows: list[int] | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This rank's part of a step's forward."""
        self.ensure_zeroed(inputs.blocks)
        metas = [self.backend.build_metadata(m) for m in inputs.metas]
        if inputs.states is not None:
            self._start_states(inputs.state_starts)
            metas.append(inputs.states)
        every_row = rows is not None and rows == list(range(len(inputs.input_ids)))
        with decode_batch(inputs.decode_batch):
            hidden, logits = self.model.hidden_and_logits(inputs.input_ids, inputs.positions, self.layer_caches,
                                                          metas, self.backend, every_row)
            if rows is None or logits is not None:
                return hidden, logits
            return hidden, self.model.compute_logits(_pick_rows(hidden, rows))

    def _start_states(self, starts: list[tuple[int, int]]) -> None:
        """Sequences that start this step: from a saved state (a prefix hit), else from zero; in
        every linear-attention layer at once."""
        for c in self.state_caches:
            c.verified.clear()
        for whole in self.states:
            for slot, source in starts:
                if source:
                    whole[:, slot].copy_(whole[:, source])
                else:
                    whole[:, slot].zero_()

    def _keep_verified_states(self, steps: list[RequestStep], results: list[StepResult]) -> None:
        """A verification step leaves each linear-attention layer's state after its last token;
        the state to keep is the one after the last accepted draft (rejected ones leave nothing)."""
        if not self.state_caches:
            return
        for i, (s, result) in enumerate(zip(steps, results)):
            if not s.num_drafts or result.num_accepted == s.num_drafts:
                continue
            for c in self.state_caches:
                conv, recurrent = c.verified[i]
                c.conv[s.state.slot].copy_(conv[result.num_accepted])
                c.recurrent[s.state.slot].copy_(recurrent[result.num_accepted])
        for c in self.state_caches:
            c.verified.clear()

    def ensure_zeroed(self, tables: list[list[int]]) -> None:
        """Zero those of these blocks (a list per KV-cache group) that were never written (see __init__)."""
        for zeroed, fills, block_ids in zip(self._zeroed, self._block_fills, tables, strict=True):
            fresh = [b for b in block_ids if not zeroed[b]]
            if not fresh:
                continue
            index = int64_tensor(fresh, self.device)
            for tensor, dim in fills:
                tensor.index_fill_(dim, index, 0)
            for b in fresh:
                zeroed[b] = 1

    def write_blocks(self, block_ids: list[int], parts: list[torch.Tensor]) -> None:
        """Store whole blocks received from another instance (prefill/decode disaggregation);
        they count as written, so they are never zeroed afterwards."""
        scatter_blocks(self.kv_caches, block_ids, parts)
        for b in block_ids:
            self._zeroed[0][b] = 1

    def _prepare(self, steps: list[RequestStep], states: list[RequestState]) -> StepInputs:
        ids: list[int] = []
        pos: list[int] = []
        starts, qlens, slens = [0], [], []
        for s in steps:
            end = s.start + s.num_tokens
            ids.extend(s.token_ids)
            pos.extend(range(s.start, end))
            starts.append(starts[-1] + s.num_tokens)
            qlens.append(s.num_tokens)
            slens.append(end)
        # Decodes, and decodes verifying drafts, share one batched attention call per layer.
        is_decode = [s.num_tokens == 1 or s.num_drafts > 0 for s in steps]
        metas, written = [], []
        for g in range(len(states[0].tables)):
            slots, table = self._group_slots([state.tables[g] for state in states], steps)
            metas.append(AttentionMetadata(query_start_loc=starts, query_lens=qlens, seq_lens=slens,
                                           slot_mapping=int64_tensor(slots, self.device), block_tables=table,
                                           block_size=self.block_size, is_decode=is_decode))
            written.append(sorted({sl // self.block_size for sl in slots}))
        inputs = StepInputs(int64_tensor(ids, self.device), int64_tensor(pos, self.device), metas, written,
                            all(s.decode for s in steps))
        if self.state_caches:
            self._prepare_states(steps, inputs)
        return inputs

    def _prepare_states(self, steps: list[RequestStep], inputs: StepInputs) -> None:
        """The linear-attention layers' layout of the step, from each request's state slots."""
        saves = {i: s.state.saves for i, s in enumerate(steps) if s.state.saves}
        meta = inputs.meta
        inputs.states = StateMetadata.build(meta.query_start_loc, meta.query_lens, [s.state.slot for s in steps],
                                            [s.num_drafts for s in steps], saves, self.device)
        inputs.state_starts = [(s.state.slot, s.state.restore) for s in steps if s.state.restore or s.state.fresh]

    def _group_slots(self, tables: list[list[int]], steps: list[RequestStep]) -> tuple[list[int], torch.Tensor]:
        """One KV-cache group's slot of every new token and its block tables [B, max blocks],
        padded with the null block."""
        bs, slots = self.block_size, []
        for s, block_ids in zip(steps, tables):
            slots.extend(block_ids[p // bs] * bs + p % bs for p in range(s.start, s.start + s.num_tokens))
        width = max(len(t) for t in tables)
        table = int64_tensor([b for t in tables for b in t + [NULL_BLOCK_ID] * (width - len(t))],
                             self.device).view(len(tables), width)
        return slots, table

    def _logit_rows(self, steps: list[RequestStep], states: list[RequestState],
                    meta: AttentionMetadata) -> _LogitRows:
        rows = _LogitRows({}, {}, {}, [])
        for i, (s, state) in enumerate(zip(steps, states)):
            if state.pooling is not None:        # pooled from the hidden states (pooler.py): no logits
                continue
            first = meta.query_start_loc[i]
            if s.prompt_logprobs_from is not None:
                # Logits at prompt position p score prompt token p + 1.
                lo = max(s.start, s.prompt_logprobs_from - 1)
                hi = min(s.start + s.num_tokens, state.num_prompt_tokens - 1)
                if hi > lo:
                    rows.prompt_rows[i] = (len(rows.flat_indices), hi - lo, lo + 1)
                    rows.flat_indices.extend(first + p - s.start for p in range(lo, hi))
            if s.num_drafts:
                rows.verify_rows[i] = len(rows.flat_indices)
                rows.flat_indices.extend(range(first, first + s.num_tokens))
            elif s.samples:
                rows.sample_index[i] = len(rows.flat_indices)
                rows.flat_indices.append(first + s.num_tokens - 1)
        return rows

    def _results(self, steps: list[RequestStep], states: list[RequestState], logits: torch.Tensor,
                 rows: _LogitRows) -> list[StepResult]:
        results = [StepResult() for _ in steps]
        for i, (row, count, target) in rows.prompt_rows.items():
            state = states[i]
            targets = state.prompt_token_ids[target:target + count]
            results[i].prompt_logprobs = prompt_logprobs(
                logits[row:row + count], targets, state.params.prompt_logprobs)
        sampling = list(rows.sample_index.items())
        if sampling:
            sample_rows = [_sampling_row(steps[i], states[i]) for i, _ in sampling]
            out = self.sampler(_pick_rows(logits, [r for _, r in sampling]), sample_rows)
            for k, (i, _) in enumerate(sampling):
                results[i].token_ids = [out.token_ids[k]]
                results[i].logprobs = [out.logprobs[k]]
        if rows.verify_rows:
            self._verify(steps, states, logits, rows.verify_rows, results)
        return results

    def _verify(self, steps: list[RequestStep], states: list[RequestState], logits: torch.Tensor,
                verify_rows: dict[int, int], results: list[StepResult]) -> None:
        drafts, picked = [], []
        for i, row in verify_rows.items():
            s, state = steps[i], states[i]
            drafts.append(DraftRow(
                SamplingRow(state.params, state.prompt_token_ids, state.output_token_ids, state.generator),
                s.drafts, s.draft_probs, s.token_bitmask))
            picked.extend(range(row, row + s.num_tokens))
        verified = self.rejection_sampler(logits[torch.tensor(picked, device=logits.device)], drafts)
        for i, v in zip(verify_rows, verified):
            results[i].token_ids, results[i].num_accepted = v.token_ids, v.num_accepted
            results[i].logprobs = v.logprobs


def _rows(kind: str, inputs: StepInputs) -> list[int]:
    """The logit rows of a step that computes every position's ("all") or each request's last ("last")."""
    if kind == "all":
        return list(range(len(inputs.input_ids)))
    return [end - 1 for end in inputs.meta.query_start_loc[1:]]


def _pick_rows(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """t[rows] (hidden states for the lm_head, logits for the sampler): a view when the rows run
    consecutively (a decode batch: every row, in order), else a copy. Neither the lm_head nor the
    sampler writes to its input, so the view is safe; a batch of 32 rows of a 152k vocabulary is
    19 MB not copied each step, and a batch-1 step saves two torch ops."""
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return t[rows[0]:rows[0] + len(rows)]
    return t[torch.tensor(rows, device=t.device)]


def _sampling_row(s: RequestStep, state: RequestState) -> SamplingRow:
    mask = None if s.token_bitmask is None else s.token_bitmask[0]
    return SamplingRow(state.params, state.prompt_token_ids, state.output_token_ids, state.generator, mask)
