"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder-30B-A3B) and Qwen2-MoE's router
without its shared expert: Qwen3's attention (q/k norms), a mixture of experts in place of the MLP
(layers/moe.py) in every `decoder_sparse_step`-th layer not in `mlp_only_layers`; softmax over the
experts, the top k kept and, with norm_topk_prob, renormalised."""
from __future__ import annotations

import dataclasses

from twostep.models.causal_lm import CausalLM
from twostep.models.config import ModelConfig
from twostep.models.families.qwen import qwen3_config
from twostep.models.family import Family, Tensors, stack_experts


class Qwen3MoeForCausalLM(CausalLM):
    pass


def moe_layers(cfg: dict) -> tuple[int, ...]:
    step, dense = int(cfg.get("decoder_sparse_step") or 1), set(cfg.get("mlp_only_layers") or ())
    return tuple(i for i in range(cfg["num_hidden_layers"]) if (i + 1) % step == 0 and i not in dense)


def moe_fields(cfg: dict) -> dict:
    """The experts' count (num_experts; num_local_experts in Mixtral's, gpt-oss's and transformers 5's
    configs), how many a token takes, and each one's intermediate size."""
    experts = cfg.get("num_experts") or cfg["num_local_experts"]
    return dict(num_experts=int(experts), num_experts_per_tok=int(cfg["num_experts_per_tok"]),
                moe_intermediate_size=int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]))


def qwen3_moe_config(cfg: dict, arch: str) -> ModelConfig:
    return dataclasses.replace(qwen3_config(cfg, arch), **moe_fields(cfg), moe_layers=moe_layers(cfg),
                               norm_topk_prob=bool(cfg.get("norm_topk_prob", False)))


def from_hf(tensors: Tensors, config: ModelConfig) -> Tensors:
    return stack_experts(tensors, config)


QWEN3_MOE = Family("qwen3_moe", Qwen3MoeForCausalLM, qwen3_moe_config, ("Qwen3MoeForCausalLM",), ("qwen3moe",),
                   from_hf)
