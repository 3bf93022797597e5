"""GLM-4 (0414): sandwich norms under GLM's names, q/k/v biases, gate/up fused in the checkpoint,
and rotary over the first half of each head in interleaved pairs. The pairs become halves at
load: q's and k's rows are permuted alike within the rotated dims, which leaves every q.k (and so
the attention) as it was while the rotation becomes the one every family uses."""
from __future__ import annotations

import torch

from twostep.layers.decoder_layer import SandwichNormLayer
from twostep.models.causal_lm import CausalLM
from twostep.models.config import ModelConfig, base_config, rope_params
from twostep.models.family import Family, Tensors, rename_layer_tensors, unfuse

_RENAMES = {"post_self_attn_layernorm": "post_attention_layernorm",
            "post_attention_layernorm": "pre_feedforward_layernorm",
            "post_mlp_layernorm": "post_feedforward_layernorm"}


class Glm4ForCausalLM(CausalLM):
    layer = SandwichNormLayer


def glm4_config(cfg: dict, arch: str) -> ModelConfig:
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    partial = rope_params(cfg).get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.5))
    return base_config(cfg, arch, qkv_bias=bool(cfg.get("attention_bias", True)),
                       rotary_dim=int(head_dim * partial))


def pairs_to_halves(rows: int, head_dim: int, rotary_dim: int) -> torch.Tensor:
    """The row order that turns each head's interleaved rotary pairs (x0, y0, x1, y1, ...) into
    halves (x0, x1, ..., y0, y1, ...); the unrotated dims stay."""
    head = torch.cat([torch.arange(0, rotary_dim, 2), torch.arange(1, rotary_dim, 2),
                      torch.arange(rotary_dim, head_dim)])
    return (torch.arange(0, rows, head_dim)[:, None] + head[None, :]).reshape(-1)


def from_hf(tensors: Tensors, config: ModelConfig) -> Tensors:
    ff = config.intermediate_size
    tensors = unfuse(rename_layer_tensors(tensors, _RENAMES), "mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj"),
                     [ff, ff])
    out = {}
    for name, t in tensors.items():
        if name.rsplit(".", 2)[-2] in ("q_proj", "k_proj"):
            order = pairs_to_halves(t.shape[0], config.head_dim, config.rotary_dim or config.head_dim)
            t = t[order] if isinstance(t, torch.Tensor) else t.rows(order)
        out[name] = t
    return out


GLM4 = Family("glm4", Glm4ForCausalLM, glm4_config, ("Glm4ForCausalLM",), ("glm4",), from_hf)
