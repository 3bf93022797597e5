"""Qwen3-Next: Qwen3.5's hybrid layers (models/families/qwen3_5.py) before Qwen3.5 reshaped their
checkpoint: each linear-attention layer's projections fused per key head (in_proj_qkvz: that head's
q, k, then its value heads' v and z; in_proj_ba: their b, a), cut here into Qwen3.5's
in_proj_qkv / z / b / a, and experts in every `decoder_sparse_step`-th layer beside a gated shared
expert. Its multi-token-prediction layer is named and formed as Qwen3.5's (qwen3_5.mtp_from_hf)."""
from __future__ import annotations

import dataclasses

import torch

from twostep.models.causal_lm import CausalLM
from twostep.models.config import ModelConfig, base_config, moe_fields, moe_layers
from twostep.models.families import qwen3_5
from twostep.models.family import Family, Tensors


class Qwen3NextForCausalLM(CausalLM):
    pass


def qwen3_next_config(cfg: dict, arch: str) -> ModelConfig:
    config = base_config(cfg, arch, **qwen3_5.hybrid_fields(cfg))
    if cfg.get("num_experts"):
        config = dataclasses.replace(config, **moe_fields(cfg), moe_layers=moe_layers(cfg),
                                     norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
                                     shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0))
    return config


def from_hf(tensors: Tensors, config: ModelConfig) -> Tensors:
    out = {}
    for name, t in tensors.items():
        if name.endswith("linear_attn.in_proj_qkvz.weight"):
            out.update(_split_qkvz(name.removesuffix("in_proj_qkvz.weight"), t, config))
        elif name.endswith("linear_attn.in_proj_ba.weight"):
            b, a = _per_key_head(t, config.linear_num_key_heads, [1, 1])
            prefix = name.removesuffix("in_proj_ba.weight")
            out[prefix + "in_proj_b.weight"], out[prefix + "in_proj_a.weight"] = b, a
        else:
            out[name] = t
    return qwen3_5.from_hf(out, config)


def _split_qkvz(prefix: str, t: torch.Tensor, c: ModelConfig) -> Tensors:
    dk, dv, share = c.linear_key_head_dim, c.linear_value_head_dim, c.linear_num_value_heads // c.linear_num_key_heads
    q, k, v, z = _per_key_head(t, c.linear_num_key_heads, [dk, dk, share * dv, share * dv])
    return {prefix + "in_proj_qkv.weight": torch.cat([q, k, v]), prefix + "in_proj_z.weight": z}


def _per_key_head(t: torch.Tensor, key_heads: int, parts: list[int]) -> list[torch.Tensor]:
    """Rows laid out per key head as [part 0 | part 1 | ...] (sizes relative to `parts`' sum) ->
    each part's rows of every key head, in head order."""
    per_head = t.reshape(key_heads, -1, t.shape[-1])
    unit = per_head.shape[1] // sum(parts)
    pieces = per_head.split([p * unit for p in parts], dim=1)
    return [p.reshape(-1, t.shape[-1]) for p in pieces]


QWEN3_NEXT = Family("qwen3_next", Qwen3NextForCausalLM, qwen3_next_config, ("Qwen3NextForCausalLM",), ("qwen3next",), from_hf,
                    mtp_from_hf=qwen3_5.mtp_from_hf)
