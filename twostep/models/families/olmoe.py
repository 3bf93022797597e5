"""OLMoE (OLMoE-1B-7B): Llama's pre-norm layers with RMSNorms over all of q's and k's heads
together (as OLMo 2's attention) and a mixture of experts in every layer: softmax over the
experts, the top k kept, renormalised where norm_topk_prob says."""
from __future__ import annotations

import dataclasses

from twostep.models.causal_lm import CausalLM
from twostep.models.config import ModelConfig, base_config, moe_fields
from twostep.models.family import Family, Tensors, stack_experts


class OlmoeForCausalLM(CausalLM):
    pass


def olmoe_config(cfg: dict, arch: str) -> ModelConfig:
    if cfg.get("clip_qkv") is not None:
        raise ValueError("clip_qkv is not supported: twostep runs OLMoE checkpoints without q/k/v clipping")
    bias = bool(cfg.get("attention_bias", False))
    return dataclasses.replace(base_config(cfg, arch, qkv_bias=bias, o_bias=bias, qk_norm="full"), **moe_fields(cfg),
                               norm_topk_prob=bool(cfg.get("norm_topk_prob", False)))


def from_hf(tensors: Tensors, config: ModelConfig) -> Tensors:
    return stack_experts(tensors, config)


OLMOE = Family("olmoe", OlmoeForCausalLM, olmoe_config, ("OlmoeForCausalLM",), ("olmoe",), from_hf)
