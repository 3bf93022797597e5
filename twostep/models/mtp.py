"""A checkpoint's multi-token-prediction (MTP) layer, Qwen3.5's and Qwen3-Next's: the module and
its load. The target model never loads these tensors (its family drops `mtp.*`); the MTP proposer
(spec_decode/mtp.py) loads them here, beside the target it drafts for.

For the draft at position p, from the target's final hidden state at p (after its final norm) and
the token at p + 1 (vLLM's qwen3_5_mtp.py / qwen3_next_mtp.py, llama.cpp's nextn layer):

    x = fc(cat(pre_fc_norm_embedding(embed(token p + 1)), pre_fc_norm_hidden(hidden p)))
    x = one full-attention decoder layer (its own K/V cache; RoPE at position p)
    logits of token p + 2 = lm_head(norm(x))

embed and lm_head are the target's. The next draft step takes norm(x) as its hidden state and the
token just drafted, at position p + 1. The layer is the family's own decoder layer, built as layer 0
of a one-layer config with the target's shapes (`mtp_config`): its gated attention, q/k norms and
partial rotary, and experts where the checkpoint gives the layer experts.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import re
from pathlib import Path

import torch
from torch import nn

from twostep.attention.backend import AttentionBackend
from twostep.distributed.parallel import TensorParallel
from twostep.layers.decoder_layer import DecoderLayer
from twostep.layers.linear import Linear
from twostep.layers.norm import RMSNorm
from twostep.models.config import FULL, ModelConfig
from twostep.models.family import Tensors
from twostep.models.registry import family_named
from twostep.models.weights import fuse_projections

logger = logging.getLogger(__name__)

PREFIX = "mtp."
_LAYER = re.compile(r"mtp\.layers\.(\d+)\.")


class MultiTokenPredictor(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: type[DecoderLayer]) -> None:
        """cfg: mtp_config's one-layer config; layer: the family's decoder layer class."""
        super().__init__()
        h = cfg.hidden_size
        self.config = cfg
        self.pre_fc_norm_embedding = RMSNorm(h, cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = RMSNorm(h, cfg.rms_norm_eps)
        self.fc = Linear(2 * h, h, bias=False)
        self.layers = nn.ModuleList([layer(cfg, 0, TensorParallel())])
        self.norm = RMSNorm(h, cfg.rms_norm_eps)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, ropes: dict, kv_cache, meta,
                backend: AttentionBackend) -> torch.Tensor:
        """embeds [T, H]: the target's embeddings of the tokens after the rows; hidden [T, H]: the
        target's final hidden states at the rows (or this layer's output, for a draft's next step)
        -> [T, H] after the final norm: what the lm_head reads and the next draft step takes."""
        x = torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], dim=-1)
        x, residual = self.layers[0](self.fc(x), None, ropes, kv_cache, meta, backend)
        return self.norm(x, residual)

    def loaded(self) -> None:
        for m in self.modules():
            if m is not self and hasattr(m, "loaded"):
                m.loaded()


def mtp_config(target: ModelConfig, moe: bool) -> ModelConfig:
    """The MTP layer's config: the target's shapes, one full-attention layer (a MoE one where the
    checkpoint's MTP layer has experts)."""
    return dataclasses.replace(target, num_layers=1, layer_types=(FULL,), no_rope_layers=(),
                               moe_layers=(0,) if moe else ())


def load_mtp(path: str, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> MultiTokenPredictor:
    """The checkpoint's MTP layer (only its mtp.* tensors are read) for a target of this config,
    on the device in dtype; ValueError where the checkpoint has none or its family cannot run it."""
    family = family_named(config.architecture)
    if family.mtp_from_hf is None:
        raise ValueError(f"model {path}: {config.architecture} has no multi-token-prediction layer that twostep "
                         "runs (Qwen3.5, Qwen3.5-MoE and Qwen3-Next checkpoints do)")
    if not (Path(path) / "config.json").is_file():
        raise ValueError(f"model {path}: MTP speculation needs the HF checkpoint folder (its mtp.* tensors); "
                         "a GGUF file does not carry them for twostep")
    tensors = _read_mtp_tensors(Path(path), dtype)
    if not tensors:
        raise ValueError(f"model {path} has no MTP weights (no mtp.* tensors in its safetensors): "
                         'speculative method "mtp" needs a checkpoint that ships its multi-token-prediction '
                         "layer; use ngram or draft_model speculation instead")
    layers = sorted({int(m[1]) for n in tensors if (m := _LAYER.match(n))})
    if len(layers) > 1:
        logger.warning("model %s has %d MTP layers; twostep drafts with the first only", path, len(layers))
    tensors = {n: t for n, t in tensors.items()
               if not n.startswith(PREFIX + "layers.") or n.startswith(PREFIX + "layers.0.")}
    moe = any(n.startswith(PREFIX + "layers.0.mlp.") and (".experts." in n or n.endswith("mlp.gate.weight"))
              for n in tensors)
    cfg = mtp_config(config, moe)
    tensors = fuse_projections(family.mtp_from_hf(tensors, cfg), 1)
    tensors = {n.removeprefix("model."): t for n, t in tensors.items()}
    with torch.device("meta"):
        module = MultiTokenPredictor(cfg, family.model.layer)
    expected = set(module.state_dict())
    unused, missing = sorted(tensors.keys() - expected), sorted(expected - tensors.keys())
    if unused or missing:
        raise ValueError(f"model {path}: its MTP tensors do not make the layer: unexpected {unused[:5]}, "
                         f"missing {missing[:5]}")
    module.load_state_dict({n: t.to(device=device, dtype=dtype) for n, t in tensors.items()}, strict=True, assign=True)
    module.loaded()
    return module.eval().requires_grad_(False)


def _read_mtp_tensors(folder: Path, dtype: torch.dtype) -> Tensors:
    """Only the mtp.* tensors of the folder's safetensors (the files that hold them)."""
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({f for n, f in weight_map.items() if n.startswith(PREFIX)})
    else:
        files = ["model.safetensors"] if (folder / "model.safetensors").is_file() else []
    out = {}
    for name in files:
        with safe_open(folder / name, framework="pt") as f:
            for key in f.keys():
                if key.startswith(PREFIX):
                    t = f.get_tensor(key)
                    out[key] = t.to(dtype) if t.is_floating_point() else t
    return out
