"""The attention backend interface, and the backend the engine uses: a prefill path and a decode
path held side by side (mini-sglang's HybridBackend), each owning the plan it builds from the
common metadata once per step."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch

from twostep.attention.kv_layer_cache import KVLayerCache, write_kv
from twostep.attention.metadata import AttentionMetadata
from twostep.attention.options import AttentionOptions


class AttentionBackend(Protocol):
    def build_metadata(self, common: AttentionMetadata) -> Any:
        """Once per step: what forward() needs, from the runner's common metadata."""
        ...

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: KVLayerCache, metadata: Any, options: AttentionOptions) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D], kv_cache: one layer's cache -> [T, H, D]."""
        ...


class DecodeAttention(Protocol):
    """Sequences with one new token each (plus drafts to verify), batched into one call per layer."""

    def build(self, common: AttentionMetadata, rows: list[int]) -> Any: ...

    def forward(self, q: torch.Tensor, kv_cache: KVLayerCache, plan: Any, options: AttentionOptions,
                out: torch.Tensor) -> None: ...


class PrefillAttention(Protocol):
    """One prompt chunk (row of the batch) at a time, causal over its cached prefix and itself."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVLayerCache,
                common: AttentionMetadata, row: int, options: AttentionOptions, out: torch.Tensor) -> None: ...


@dataclass(slots=True)
class HybridMetadata:
    common: AttentionMetadata
    prefill_rows: list[int]
    decode: Any                      # the decode path's plan; None when no row decodes


class HybridBackend:
    def __init__(self, prefill: PrefillAttention, decode: DecodeAttention,
                 write_values: Callable | None = None) -> None:
        """write_values(values, k, v, slots): a platform's one-call K/V write for unquantized caches
        (None: attention/kv_layer_cache.py's write_kv)."""
        self.prefill, self.decode = prefill, decode
        self.write_values = write_values

    def build_metadata(self, common: AttentionMetadata) -> HybridMetadata:
        decode_rows = [i for i, d in enumerate(common.is_decode) if d]
        prefill_rows = [i for i, d in enumerate(common.is_decode) if not d]
        plan = self.decode.build(common, decode_rows) if decode_rows else None
        return HybridMetadata(common, prefill_rows, plan)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVLayerCache,
                metadata: HybridMetadata, options: AttentionOptions) -> torch.Tensor:
        if self.write_values is not None and kv_cache.scales is None:
            self.write_values(kv_cache.values, k, v, metadata.common.slot_mapping)
        else:
            write_kv(kv_cache, k, v, metadata.common.slot_mapping)
        out = torch.empty_like(q)
        if metadata.decode is not None:
            self.decode.forward(q, kv_cache, metadata.decode, options, out)
        for row in metadata.prefill_rows:
            self.prefill.forward(q, k, v, kv_cache, metadata.common, row, options, out)
        return out
