"""From checkpoint tensor names (HF's) to the decoder's: q/k/v and gate/up are concatenated
along the output dimension so each runs as one matmul. Quantized parts stack as one
QuantizedWeight (one packed matrix where their formats agree)."""
from __future__ import annotations

import torch

from twostep.quantization.packed import QuantizedWeight

# a part ending in "?" joins where the checkpoint has it (the output gate of Qwen3.5's attention)
_FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.gate_proj?"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.shared_expert.gate_up_proj": ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj"),
}


def fuse_projections(tensors: dict[str, torch.Tensor | QuantizedWeight],
                     num_layers: int) -> dict[str, torch.Tensor | QuantizedWeight]:
    """Return the tensors with each layer's q/k/v and gate/up (weights and biases) fused;
    a group with only some of its parts is an incomplete checkpoint, reported by HF name."""
    out = dict(tensors)
    for i in range(num_layers):
        prefix = f"model.layers.{i}."
        for fused, parts in _FUSED.items():
            for kind in ("weight", "bias"):
                names = [f"{prefix}{part.rstrip('?')}.{kind}" for part in parts
                         if not part.endswith("?") or f"{prefix}{part[:-1]}.{kind}" in out]
                present = [n for n in names if n in out]
                if present and len(present) < len(names):
                    missing = sorted(set(names) - set(present))
                    raise ValueError(f"checkpoint lacks tensors: {missing}")
                if present:
                    out[f"{prefix}{fused}.{kind}"] = _stack([out.pop(n) for n in names])
    return out


def _stack(parts: list[torch.Tensor | QuantizedWeight]) -> torch.Tensor | QuantizedWeight:
    floats = [p for p in parts if isinstance(p, torch.Tensor)]
    if not floats:
        return QuantizedWeight.stack(parts)
    # a file that quantizes some parts of a projection and not others: the whole in float
    return torch.cat([p if isinstance(p, torch.Tensor) else p.dequantize(floats[0].dtype) for p in parts])
