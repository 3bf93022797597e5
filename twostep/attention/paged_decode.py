"""Decode attention through a platform's paged kernel (the CPU's: platforms/cpu/paged_attention.py),
which reads each sequence's K/V blocks where they lie instead of gathering and padding them.
Measured per layer (benchmarks/bench_decode_attention.py, bf16, SmolLM2's 3 KV heads, 2 threads):
8 sequences of 1,000 tokens 0.30-0.38 ms against the reference's 1.3; 32 of 200 tokens 0.26
against 0.91; 8 sequences verifying 4 drafts each 0.79-0.83 against 2.6-2.8."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from twostep.attention.kv_layer_cache import KVLayerCache
from twostep.attention.metadata import AttentionMetadata, DecodeRows, blocks_for, int64_tensor
from twostep.attention.options import AttentionOptions


@dataclass(slots=True)
class PagedDecodePlan:
    rows: DecodeRows
    tables: torch.Tensor             # [B, blocks covering the longest context]
    query_lens: torch.Tensor         # [B] new tokens of each sequence (int64)
    seq_lens: torch.Tensor           # [B] its context after this step (int64)


class PagedDecode:
    def __init__(self, kernel: Callable) -> None:
        self.kernel = kernel
        # a batch of B decodes that is every row, one query each: its query rows (arange) and query
        # lengths (ones), the same every such step, made once for each B (the kernel only reads them)
        self._one_query_each: dict[tuple[int, torch.device], tuple[DecodeRows, torch.Tensor]] = {}

    def build(self, common: AttentionMetadata, rows: list[int]) -> PagedDecodePlan:
        device = common.block_tables.device
        lens = [common.seq_lens[r] for r in rows]
        width = blocks_for(max(lens), common.block_size)
        if len(rows) == len(common.seq_lens):    # every row, in order: the tables as they are
            tables = common.block_tables[:, :width].contiguous()
            if max(common.query_lens) == 1:
                decode_rows, query_lens = self._whole_batch(len(rows), device)
                return PagedDecodePlan(decode_rows, tables, query_lens, int64_tensor(lens, device))
        else:
            tables = common.block_tables[rows, :width]
        return PagedDecodePlan(DecodeRows.build(common, rows), tables,
                               int64_tensor([common.query_lens[r] for r in rows], device),
                               int64_tensor(lens, device))

    def _whole_batch(self, batch: int, device: torch.device) -> tuple[DecodeRows, torch.Tensor]:
        key = (batch, device)
        if key not in self._one_query_each:
            index = torch.arange(batch, device=device).view(batch, 1)
            self._one_query_each[key] = (DecodeRows(index, None, True),
                                         torch.ones(batch, dtype=torch.int64, device=device))
        return self._one_query_each[key]

    def forward(self, q: torch.Tensor, kv_cache: KVLayerCache, plan: PagedDecodePlan, options: AttentionOptions,
                out: torch.Tensor) -> None:
        o = self.kernel(q, plan.rows.index, plan.query_lens, kv_cache.values, plan.tables,
                        plan.seq_lens, options)
        plan.rows.scatter(out, o)
