"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder-30B-A3B) and Qwen2-MoE's router
without its shared expert: Qwen3's attention (q/k norms), a mixture of experts in place of the MLP
(layers/moe.py) in every `decoder_sparse_step`-th layer not in `mlp_only_layers`; softmax over the
experts, the top k kept and, with norm_topk_prob, renormalised."""
from __future__ import annotations

import dataclasses

from twostep.models.causal_lm import CausalLM
from twostep.models.config import ModelConfig, moe_fields, moe_layers
from twostep.models.families.qwen import qwen3_config
from twostep.models.family import Family, Tensors, stack_experts


class Qwen3MoeForCausalLM(CausalLM):
    pass


def qwen3_moe_config(cfg: dict, arch: str) -> ModelConfig:
    return dataclasses.replace(qwen3_config(cfg, arch), **moe_fields(cfg), moe_layers=moe_layers(cfg),
                               norm_topk_prob=bool(cfg.get("norm_topk_prob", False)))


def from_hf(tensors: Tensors, config: ModelConfig) -> Tensors:
    return stack_experts(tensors, config)


QWEN3_MOE = Family("qwen3_moe", Qwen3MoeForCausalLM, qwen3_moe_config, ("Qwen3MoeForCausalLM",), ("qwen3moe",),
                   from_hf)
