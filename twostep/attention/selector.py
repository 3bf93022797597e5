"""`--attention-backend`: which decode path sits beside the reference prefill path.

auto: the platform's paged decode kernel where it applies (CPU, float32/bf16, unquantized cache)
and builds, else the reference decode; reference: PyTorch only; cpu_paged: as auto, but an error
where the kernel cannot be built."""
from __future__ import annotations

import torch

from twostep.attention.backend import HybridBackend
from twostep.attention.paged_decode import PagedDecode
from twostep.attention.reference import ReferenceDecode, ReferencePrefill
from twostep.config import KVFormat, kv_format
from twostep.platforms import Platform, get_platform

BACKENDS = ("auto", "reference", "cpu_paged")


def get_attention_backend(name: str = "auto", platform: Platform | None = None,
                          dtype: torch.dtype = torch.float32,
                          kv: KVFormat | None = None) -> HybridBackend:
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}: available: {', '.join(BACKENDS)}")
    platform = platform or get_platform(torch.device("cpu"))
    kv = kv or kv_format("auto")
    if name == "cpu_paged" and platform.paged_decode_attention(torch.float32, False) is None:
        raise ValueError("attention backend cpu_paged: its C++ kernel could not be built (see the log) "
                         "or this is not a CPU")
    # The cache's storage decides; where the kernel does not apply (8-bit or float16 caches),
    # decodes take the reference path.
    kernel = None
    if name != "reference":
        kernel = platform.paged_decode_attention(kv.storage or dtype, kv.quantized)
    # the one-call writer stores k/v as they are: only into a cache of the model's own dtype (a float32
    # cache under a bf16 model takes write_kv's conversion)
    same_dtype = (kv.storage or dtype) == dtype
    writer = platform.kv_cache_write(dtype, kv.quantized) if name != "reference" and same_dtype else None
    return HybridBackend(ReferencePrefill(), PagedDecode(kernel) if kernel else ReferenceDecode(), writer)
