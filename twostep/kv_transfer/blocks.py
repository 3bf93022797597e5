"""What a KV transfer moves: whole blocks of every layer's cache (K and V values, and the scales
of 8-bit formats), and the layout both sides must share for the bytes to mean the same thing.

A payload is a list of plain byte tensors, one per layer for values (then one per layer for
scales), each holding the chosen blocks in the cache's own order: [2, blocks, block_size,
kv_heads, head_dim]. Copies are bitwise, so every storage type (bf16, fp8) travels unchanged.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from twostep.attention.kv_layer_cache import KVLayerCache


@dataclass(slots=True, frozen=True)
class CacheLayout:
    """Exchanged at handshake: a consumer refuses a producer whose layout differs."""

    num_layers: int
    block_size: int
    kv_heads: int
    head_dim: int
    dtype: str             # the stored values' type (int8, float8_e4m3fn, bfloat16, ...)
    scaled: bool           # 8-bit formats carry a scale per token and head

    @classmethod
    def of(cls, caches: list[KVLayerCache]) -> "CacheLayout":
        _, _, block_size, heads, dim = caches[0].values.shape
        return cls(len(caches), block_size, heads, dim, str(caches[0].values.dtype).removeprefix("torch."),
                   caches[0].scales is not None)

    def as_dict(self) -> dict:
        return asdict(self)

    def mismatches(self, other: dict) -> list[str]:
        """What differs from a peer's layout, as 'field here vs there' phrases."""
        return [f"{k} {v} here, {other.get(k)} there" for k, v in self.as_dict().items() if other.get(k) != v]


def gather_blocks(caches: list[KVLayerCache], block_ids: list[int]) -> list[torch.Tensor]:
    """The blocks' bytes in every layer (values, then scales), contiguous, for sending."""
    index = torch.tensor(block_ids, dtype=torch.int64, device=caches[0].values.device)
    parts = [_bytes(c.raw_values.index_select(1, index)) for c in caches]
    if caches[0].scales is not None:
        parts += [_bytes(c.scales.index_select(1, index)) for c in caches]
    return parts


def scatter_blocks(caches: list[KVLayerCache], block_ids: list[int], parts: list[torch.Tensor]) -> None:
    """Write received bytes into these blocks (the inverse of gather_blocks on the same layout)."""
    index = torch.tensor(block_ids, dtype=torch.int64, device=caches[0].values.device)
    expected = len(caches) * (2 if caches[0].scales is not None else 1)
    if len(parts) != expected:
        raise ValueError(f"KV payload has {len(parts)} parts, this cache needs {expected}")
    for i, cache in enumerate(caches):
        _write(cache.raw_values, index, parts[i])
        if cache.scales is not None:
            _write(cache.scales, index, parts[len(caches) + i])


def payload_bytes(parts: list[torch.Tensor]) -> int:
    return sum(p.numel() for p in parts)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """As plain bytes in host memory (what the transport sends)."""
    return t.contiguous().view(torch.uint8).reshape(-1).cpu()


def _write(dest: torch.Tensor, index: torch.Tensor, raw: torch.Tensor) -> None:
    shape = (dest.shape[0], len(index), *dest.shape[2:])
    need = dest.element_size() * torch.Size(shape).numel()
    if raw.numel() != need:
        raise ValueError(f"KV payload part has {raw.numel()} bytes, {need} expected for {len(index)} blocks")
    dest.index_copy_(1, index, raw.to(dest.device).view(dest.dtype).view(shape))
