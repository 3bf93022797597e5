"""Mixtral (8x7B, 8x22B): Llama's attention (with Mistral's window where the config sets one) and a
mixture of experts in every layer: softmax over the experts, the top k renormalised. Its
checkpoint names the experts' projections w1 (gate), w3 (up) and w2 (down), the block
block_sparse_moe."""
from __future__ import annotations

import dataclasses

from twostep.models.causal_lm import CausalLM
from twostep.models.config import ModelConfig, moe_fields
from twostep.models.families.llama import mistral_config
from twostep.models.family import Family, Tensors, rename_layer_tensors, stack_experts


class MixtralForCausalLM(CausalLM):
    pass


def mixtral_config(cfg: dict, arch: str) -> ModelConfig:
    return dataclasses.replace(mistral_config(cfg, arch), **moe_fields(cfg), norm_topk_prob=True)


def from_hf(tensors: Tensors, config: ModelConfig) -> Tensors:
    tensors = rename_layer_tensors(tensors, {"block_sparse_moe": "mlp"})
    return stack_experts(tensors, config, {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"})


MIXTRAL = Family("mixtral", MixtralForCausalLM, mixtral_config, ("MixtralForCausalLM",), (), from_hf)
