"""What a family file declares (models/families/): its config reader, its model class, how its
checkpoint's tensors become the model's; and the tensor transforms family files share."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from twostep.models.config import ModelConfig

Tensors = dict[str, Any]        # name -> torch.Tensor or QuantizedWeight
@dataclass(frozen=True)
class Family:
    name: str
    model: type                                 # a CausalLM subclass
    config: Callable[[dict[str, Any], str], ModelConfig]   # (HF config, architecture) -> ModelConfig
    hf_architectures: tuple[str, ...]
    gguf_architectures: tuple[str, ...] = ()
    # HF checkpoint tensors -> the names and forms the model loads (layers.N.<HF name> for unfused
    # q/k/v and gate/up); None: as they are
    from_hf: Callable[[Tensors, ModelConfig], Tensors] | None = None
    # what a checkpoint may carry that the model does not use (vision towers of a multimodal one)
    ignored: tuple[str, ...] = field(default_factory=tuple)



def add_one_to_norms(tensors: Tensors, names: tuple[str, ...]) -> Tensors:
    """Gemma's RMSNorm multiplies by (1 + w): folded into the weight at load, as llama.cpp's
    converter does, so every norm kernel serves it. In float32, then cast back."""
    out = {}
    for name, t in tensors.items():
        if name.endswith(".weight") and name.rsplit(".", 2)[-2] in names:
            t = (1.0 + t.float()).to(t.dtype)
        out[name] = t
    return out


def rename_layer_tensors(tensors: Tensors, renames: dict[str, str]) -> Tensors:
    """layers.N.<old>.* -> layers.N.<new>.*, all at once (a rename may take a name another gives up)."""
    out = {}
    for name, t in tensors.items():
        parts = name.split(".")
        if len(parts) > 4 and parts[1] == "layers" and parts[3] in renames:
            parts[3] = renames[parts[3]]
        out[".".join(parts)] = t
    return out


def split_rows(t, sizes: list[int]) -> list:
    """A fused projection's rows cut into its parts (float or packed quantized)."""
    if isinstance(t, torch.Tensor):
        return list(t.split(sizes, dim=0))
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [t.row_range(s, s + n) for s, n in zip(starts, sizes)]


def unfuse(tensors: Tensors, fused: str, parts: tuple[str, ...], sizes: list[int]) -> Tensors:
    """A checkpoint's fused projection (Phi-3's qkv_proj, gate_up_proj) as its parts, so that
    tensor-parallel sharding and quantization see the names every family has."""
    out = {}
    for name, t in tensors.items():
        module, _, kind = name.rpartition(".")
        if module.endswith(fused):
            prefix = module[: -len(fused)]
            for part, piece in zip(parts, split_rows(t, sizes)):
                out[f"{prefix}{part}.{kind}"] = piece
        else:
            out[name] = t
    return out
