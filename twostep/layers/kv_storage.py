"""How one layer's K/V are stored: the model's float type, or 8 bits with a scale per token
and per KV head (int8, fp8 e4m3, fp8 e5m2).

Scales are dynamic (absmax of each token's head vector), so no calibration is needed, and
stored in bfloat16 beside the blocks: 2 bytes per head_dim values, ~3% overhead at head_dim 64.
Values are quantised with the stored (rounded) scale and clamped to the format's range, so
the round trip never produces NaN or Inf.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

SCALE_DTYPE = torch.bfloat16


@dataclass(slots=True, frozen=True)
class KVFormat:
    name: str
    storage: torch.dtype | None     # None: the model's compute dtype
    qmax: float | None = None       # largest stored magnitude; None: unscaled float storage

    @property
    def quantized(self) -> bool:
        return self.qmax is not None

    def bytes_per_token(self, layers: int, kv_heads: int, head_dim: int, compute: torch.dtype) -> int:
        """K and V of one token in every layer, scales included."""
        storage = self.storage or compute
        per_head = head_dim * torch.empty((), dtype=storage).element_size()
        if self.quantized:
            per_head += torch.empty((), dtype=SCALE_DTYPE).element_size()
        return 2 * layers * kv_heads * per_head


KV_FORMATS = {
    "auto": KVFormat("auto", None),
    "bfloat16": KVFormat("bfloat16", torch.bfloat16),
    "float16": KVFormat("float16", torch.float16),
    "float32": KVFormat("float32", torch.float32),
    "int8": KVFormat("int8", torch.int8, 127.0),
    "fp8_e4m3": KVFormat("fp8_e4m3", torch.float8_e4m3fn, 448.0),
    "fp8_e5m2": KVFormat("fp8_e5m2", torch.float8_e5m2, 57344.0),
}


def kv_format(name: str) -> KVFormat:
    if name not in KV_FORMATS:
        raise ValueError(f"kv_cache_dtype {name!r} is not one of {', '.join(KV_FORMATS)}")
    return KV_FORMATS[name]


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
