"""One layer's K/V cache and how new K/V are written to it: the model's float type, or 8 bits
with a scale per token and per KV head (int8, fp8 e4m3, fp8 e5m2; config/kv_cache_dtype.py).

Scales are dynamic (absmax of each token's head vector), so no calibration is needed, and
stored in bfloat16 beside the blocks: 2 bytes per head_dim values, ~3% overhead at head_dim 64.
Values are quantised with the stored (rounded) scale and clamped to the format's range, so
the round trip never produces NaN or Inf.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from twostep.config.kv_cache_dtype import SCALE_DTYPE, KVFormat


def quantize(x: torch.Tensor, fmt: KVFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (values [..., D] in fmt.storage, scales [...] in SCALE_DTYPE)."""
    xf = x.float()
    absmax = xf.abs().amax(dim=-1)
    scale = (absmax / fmt.qmax).clamp_min(torch.finfo(SCALE_DTYPE).tiny).to(SCALE_DTYPE)
    scaled = (xf / scale.float().unsqueeze(-1)).clamp(-fmt.qmax, fmt.qmax)
    if fmt.storage == torch.int8:
        scaled = scaled.round()
    return scaled.to(fmt.storage), scale


def dequantize(values: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (values.float() * scale.float().unsqueeze(-1)).to(dtype)


@dataclass(slots=True)
class KVLayerCache:
    """One layer's K and V: values [2, num_blocks, block_size, kv_heads, head_dim] and, for 8-bit
    formats, a scale per token and head [2, num_blocks, block_size, kv_heads]."""

    values: torch.Tensor
    scales: torch.Tensor | None
    fmt: KVFormat

    @property
    def num_blocks(self) -> int:
        return self.values.shape[1]

    @property
    def raw_values(self) -> torch.Tensor:
        """The values as plain bytes where torch lacks an op for the storage type (fp8 on CPU
        has no index_copy_/index_fill_): copies and fills are bitwise, so a uint8 view works."""
        if self.values.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            return self.values.view(torch.uint8)
        return self.values

    def zero_blocks(self, index: torch.Tensor) -> None:
        self.raw_values.index_fill_(1, index, 0)
        if self.scales is not None:
            self.scales.index_fill_(1, index, 0)


def write_kv(cache: KVLayerCache, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """Store the new tokens' K and V at their slots (quantised first for 8-bit formats)."""
    num_blocks, block_size, heads, dim = cache.values.shape[1:]
    flat = cache.values.view(2, num_blocks * block_size, heads, dim)
    if cache.scales is None:
        flat[0].index_copy_(0, slots, k.to(flat.dtype))
        flat[1].index_copy_(0, slots, v.to(flat.dtype))
        return
    raw = cache.raw_values.view(2, num_blocks * block_size, heads, dim)
    scales = cache.scales.view(2, num_blocks * block_size, heads)
    for i, x in enumerate((k, v)):
        q, scale = quantize(x, cache.fmt)
        raw[i].index_copy_(0, slots, q.view(raw.dtype))
        scales[i].index_copy_(0, slots, scale)
