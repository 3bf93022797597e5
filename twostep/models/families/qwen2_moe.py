"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention (q/k/v biases) and a mixture of
experts beside a shared expert every token takes, its output gated by sigmoid(shared_expert_gate(x))
(layers/moe.py), in every `decoder_sparse_step`-th layer not in `mlp_only_layers`."""
from __future__ import annotations

import dataclasses

from twostep.models.causal_lm import CausalLM
from twostep.models.config import ModelConfig, moe_fields, moe_layers
from twostep.models.families.qwen import qwen2_config
from twostep.models.family import Family, Tensors, stack_experts


class Qwen2MoeForCausalLM(CausalLM):
    pass


def qwen2_moe_config(cfg: dict, arch: str) -> ModelConfig:
    return dataclasses.replace(qwen2_config(cfg, arch), **moe_fields(cfg), moe_layers=moe_layers(cfg),
                               norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                               shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0))


def from_hf(tensors: Tensors, config: ModelConfig) -> Tensors:
    return stack_experts(tensors, config)


QWEN2_MOE = Family("qwen2_moe", Qwen2MoeForCausalLM, qwen2_moe_config, ("Qwen2MoeForCausalLM",), (), from_hf)
