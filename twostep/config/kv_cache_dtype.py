"""`--kv-cache-dtype`: how K/V are stored, the model's float type or 8 bits with a scale per token
and per KV head (int8, fp8 e4m3, fp8 e5m2). Scales are bfloat16: 2 bytes per head_dim values, ~3%
overhead at head_dim 64 (attention/kv_layer_cache.py quantises and dequantises)."""
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


# vLLM's and PyTorch's other spellings: fp8 is fp8_e4m3 (vLLM's default fp8 KV), bf16 bfloat16, ...
KV_ALIASES = {"fp8": "fp8_e4m3", "fp8_e4m3fn": "fp8_e4m3", "bf16": "bfloat16", "fp16": "float16",
              "half": "float16", "fp32": "float32", "float": "float32"}


def canonical_kv_dtype(name: str) -> str:
    return KV_ALIASES.get(name, name)


def kv_format(name: str) -> KVFormat:
    name = canonical_kv_dtype(name)
    if name not in KV_FORMATS:
        raise ValueError(f"kv_cache_dtype {name!r} is not one of {', '.join(KV_FORMATS)}")
    return KV_FORMATS[name]
