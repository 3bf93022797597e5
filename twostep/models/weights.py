"""From checkpoint tensor names (HF's) to the decoder's: q/k/v and gate/up are concatenated
along the output dimension so each runs as one matmul."""
from __future__ import annotations

import torch

_FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def fuse_projections(tensors: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """Return the tensors with each layer's q/k/v and gate/up (weights and biases) fused;
    a group with only some of its parts is an incomplete checkpoint, reported by HF name."""
    out = dict(tensors)
    for i in range(num_layers):
        prefix = f"model.layers.{i}."
        for fused, parts in _FUSED.items():
            for kind in ("weight", "bias"):
                names = [f"{prefix}{part}.{kind}" for part in parts]
                present = [n for n in names if n in out]
                if present and len(present) < len(names):
                    missing = sorted(set(names) - set(present))
                    raise ValueError(f"checkpoint lacks tensors: {missing}")
                if present:
                    out[f"{prefix}{fused}.{kind}"] = torch.cat([out.pop(n) for n in names], dim=0)
    return out
