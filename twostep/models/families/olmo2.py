"""OLMo 2: norms after each sub-layer instead of before (PostNormLayer), and RMSNorms over all
of q's and k's heads together."""
from __future__ import annotations

from twostep.layers.decoder_layer import PostNormLayer
from twostep.models.causal_lm import CausalLM
from twostep.models.config import ModelConfig, base_config
from twostep.models.family import Family


class Olmo2ForCausalLM(CausalLM):
    layer = PostNormLayer


def olmo2_config(cfg: dict, arch: str) -> ModelConfig:
    bias = bool(cfg.get("attention_bias", False))
    return base_config(cfg, arch, qkv_bias=bias, o_bias=bias, qk_norm="full")


OLMO2 = Family("olmo2", Olmo2ForCausalLM, olmo2_config, ("Olmo2ForCausalLM",), ("olmo2",))
