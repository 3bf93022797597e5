"""Formats quantized at load from a float checkpoint (--quantization, vLLM's flag), into the same
packed layout and kernels as GGUF's types:

* int8: weight-only, symmetric, one scale per output channel (row): scale = max|w| / 127.
* int4: weight-only, asymmetric, groups of 32 along the input: w ~ min + scale * q, q in 0..15,
  scale = (max - min) / 15 (5.0 bits per weight with its float16 scale and min).

Rows whose length is not a whole number of 32-weight blocks stay in float (the kernels read whole
blocks).
"""
from __future__ import annotations

import torch

from twostep.quantization.packed import BLOCK, PackedFormat, PackedWeight, pack

def can_quantize(weight: torch.Tensor) -> bool:
    return weight.dim() == 2 and weight.shape[1] % BLOCK == 0


def quantize_weight(weight: torch.Tensor, method: str) -> PackedWeight:
    """A float [n, k] matrix in `method`'s format."""
    w = weight.detach().float()
    n, k = w.shape
    if method == "int8":
        scale = _as_stored(w.abs().amax(dim=1, keepdim=True) / 127)
        codes = torch.round(w / torch.where(scale > 0, scale, 1.0)).clamp(-127, 127).to(torch.int8)
        return pack(codes.numpy(), scale.numpy(), None, PackedFormat(8, k, False, "int8"))
    if method == "int4":
        groups = w.view(n, k // BLOCK, BLOCK)
        low, high = groups.amin(dim=-1, keepdim=True), groups.amax(dim=-1, keepdim=True)
        low = _as_stored(low)
        scale = _as_stored((high - low) / 15)
        codes = torch.round((groups - low) / torch.where(scale > 0, scale, 1.0)).clamp(0, 15).to(torch.uint8)
        return pack(codes.view(n, k).numpy(), scale.squeeze(-1).numpy(), low.squeeze(-1).numpy(),
                    PackedFormat(4, BLOCK, True, "int4"))
    raise ValueError(f"no quantization method {method!r}")


def _as_stored(values: torch.Tensor) -> torch.Tensor:
    """Scales and mins as the packed layout keeps them (float16), so codes are rounded against
    the values the kernels will use."""
    return values.half().float()
