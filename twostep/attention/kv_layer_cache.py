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
    group: int = 0               # its KV-cache group: whose block table and slots it takes

    @property
    def num_blocks(self) -> int:
        return self.values.shape[1]

    @property
    def raw_values(self) -> torch.Tensor:
        return _raw(self.values)


def _raw(t: torch.Tensor) -> torch.Tensor:
    """t as plain bytes where torch lacks an op for its storage type (fp8 on CPU has no
    index_copy_/index_fill_): copies and fills are bitwise, so a uint8 view works."""
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t


def block_fills(caches: list[KVLayerCache]) -> list[tuple[torch.Tensor, int]]:
    """(tensor, its block dimension) pairs whose index_fill_ zeroes blocks in every layer: where the
    layers' caches are views of one tensor [layers, 2, blocks, ...], layer i its [i] (allocate_kv_cache
    makes them so), that tensor, one fill for all layers (a fill costs microseconds of dispatch, and a
    model has 24-32 layers); else each layer's own."""
    fills = []
    for part in ("values", "scales"):
        layers = [getattr(c, part) for c in caches]
        if layers[0] is None:
            continue
        whole = layers[0]._base
        if (whole is not None and whole.dim() == layers[0].dim() + 1 and whole.shape[0] == len(layers)
                and all(t._base is whole and t.data_ptr() == whole[i].data_ptr() and t.shape == whole.shape[1:]
                        for i, t in enumerate(layers))):
            fills.append((_raw(whole), 2))
        else:
            fills.extend((_raw(t), 1) for t in layers)
    return fills


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
