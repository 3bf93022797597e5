"""Granite 3: Llama's layers with four multipliers: embeddings, each residual branch, the
attention scores (instead of head_dim ** -0.5) and the logits (divided by logits_scaling)."""
from __future__ import annotations

from twostep.models.causal_lm import CausalLM
from twostep.models.config import ModelConfig, base_config
from twostep.models.family import Family


class GraniteForCausalLM(CausalLM):
    pass


def granite_config(cfg: dict, arch: str) -> ModelConfig:
    bias = bool(cfg.get("attention_bias", False))
    return base_config(cfg, arch, qkv_bias=bias, o_bias=bias,
                       embed_scale=float(cfg.get("embedding_multiplier", 1.0)),
                       residual_scale=float(cfg.get("residual_multiplier", 1.0)),
                       query_scale=float(cfg["attention_multiplier"]) if cfg.get("attention_multiplier") else None,
                       logit_scale=1.0 / float(cfg.get("logits_scaling", 1.0)))


GRANITE = Family("granite", GraniteForCausalLM, granite_config, ("GraniteForCausalLM",), ("granite",))
