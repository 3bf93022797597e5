"""What a family file declares (models/families/): its config reader, its model class, how its
checkpoint's tensors become the model's; and the tensor transforms family files share."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from twostep.models.config import ModelConfig
from twostep.quantization.packed import QuantizedWeight

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
    # the checkpoint's multi-token-prediction layer (mtp.* tensors, which the target does not load)
    # -> the names and forms models/mtp.py loads (model.layers.0.*, model.fc, ...; the config is the
    # layer's own, models/mtp.py's mtp_config); None: the family has no such layer
    mtp_from_hf: Callable[[Tensors, ModelConfig], Tensors] | None = None


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


_EXPERT = re.compile(r"(model\.layers\.\d+\.mlp\.experts\.)(\d+)\.(\w+)\.(weight|bias)")
_PROJECTIONS = {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"}


def stack_experts(tensors: Tensors, config: ModelConfig, names: dict[str, str] = _PROJECTIONS) -> Tensors:
    """A checkpoint's experts one by one (layers.N.mlp.experts.E.<name>, `names` to gate_proj,
    up_proj, down_proj) stacked into the MoE block's weights (layers/moe.py: experts.gate_proj
    [E * I, H], ...); transformers 5's stacked form (experts.gate_up_proj [E, 2I, H], experts.down_proj
    [E, H, I]) cut the same way."""
    out, experts = {}, {}
    for name, t in tensors.items():
        if (m := _EXPERT.fullmatch(name)) is not None and m[3] in names:
            experts.setdefault((m[1], names[m[3]], m[4]), {})[int(m[2])] = t
        elif name.endswith("mlp.experts.gate_up_proj") and isinstance(t, torch.Tensor) and t.dim() == 3:
            gate, up = t.chunk(2, dim=1)
            out[name.replace("gate_up_proj", "gate_proj.weight")] = gate.reshape(-1, t.shape[-1])
            out[name.replace("gate_up_proj", "up_proj.weight")] = up.reshape(-1, t.shape[-1])
        elif name.endswith("mlp.experts.down_proj") and isinstance(t, torch.Tensor) and t.dim() == 3:
            out[name + ".weight"] = t.reshape(-1, t.shape[-1])
        else:
            out[name] = t
    for (prefix, proj, kind), by_expert in experts.items():
        if sorted(by_expert) != list(range(config.num_experts)):
            raise ValueError(f"{prefix}*.{proj}: the checkpoint has experts {sorted(by_expert)[:8]}..., "
                             f"the config {config.num_experts}")
        out[f"{prefix}{proj}.{kind}"] = stack_rows([by_expert[e] for e in range(config.num_experts)])
    return out


def stack_rows(parts: list) -> Any:
    """Matrices (or biases) stacked along their rows, float or packed quantized."""
    if all(isinstance(p, torch.Tensor) for p in parts):
        return torch.cat(parts)
    if all(isinstance(p, QuantizedWeight) for p in parts):
        return QuantizedWeight.stack(parts)
    return torch.cat([p if isinstance(p, torch.Tensor) else p.dequantize() for p in parts])
