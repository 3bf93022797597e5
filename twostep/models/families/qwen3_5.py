"""Qwen3.5 / Qwen3.6, dense and MoE: hybrid layers, three of four Gated DeltaNet linear attention
(layers/gated_deltanet.py: a state per sequence, no K/V) and every fourth full attention with an
output gate (q_proj's rows per head: the query, then its gate), RoPE on a quarter of the head, q/k
norms; RMSNorm times (1 + w) (folded at load, not in the DeltaNet's gated norm). The MoE variant
routes every layer's MLP to its experts (softmax, top k renormalised) beside a gated shared expert.
A Qwen3_5ForConditionalGeneration checkpoint loads its text model; the vision tower is not loaded
and images are not accepted. The multi-token-prediction layer (mtp.*) is not the target's either:
models/mtp.py loads it for MTP speculation (mtp_from_hf below), the target drops it."""
from __future__ import annotations

import dataclasses

import torch

from twostep.models.causal_lm import CausalLM
from twostep.models.config import FULL, LINEAR, ModelConfig, base_config, moe_fields
from twostep.models.family import Family, Tensors, add_one_to_norms, stack_experts

_NORMS = ("input_layernorm", "post_attention_layernorm", "q_norm", "k_norm", "norm")
_VISION = ("model.visual.", "visual.", "mtp.")


class Qwen3_5ForCausalLM(CausalLM):
    pass


def text_config(cfg: dict) -> dict:
    """A multimodal checkpoint keeps the language model's settings in text_config."""
    return {**cfg, **cfg["text_config"]} if "text_config" in cfg else cfg


def hybrid_fields(cfg: dict) -> dict:
    """The layer kinds and the linear-attention shape (Qwen3.5 and Qwen3-Next share them)."""
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types") or [
        FULL if (i + 1) % int(cfg.get("full_attention_interval", 4)) == 0 else LINEAR for i in range(n)]
    odd = sorted(set(types) - {FULL, LINEAR})
    if odd:
        raise ValueError(f"unsupported layer types {odd}: Qwen3.5 has {FULL} and {LINEAR}")
    return dict(layer_types=tuple(types), qk_norm="head", attn_output_gate=True,
                linear_num_key_heads=int(cfg["linear_num_key_heads"]),
                linear_num_value_heads=int(cfg["linear_num_value_heads"]),
                linear_key_head_dim=int(cfg["linear_key_head_dim"]),
                linear_value_head_dim=int(cfg["linear_value_head_dim"]),
                linear_conv_kernel=int(cfg.get("linear_conv_kernel_dim", 4)))


def qwen3_5_config(cfg: dict, arch: str) -> ModelConfig:
    text = text_config(cfg)
    if "intermediate_size" not in text:         # the MoE configs name only the experts' size
        text = {**text, "intermediate_size": text["moe_intermediate_size"]}
    config = base_config(text, arch, **hybrid_fields(text))
    if text.get("num_experts"):
        config = dataclasses.replace(config, **moe_fields(text), norm_topk_prob=True,
                                     shared_expert_intermediate_size=int(text["shared_expert_intermediate_size"]))
    return config


def from_hf(tensors: Tensors, config: ModelConfig) -> Tensors:
    out = {}
    for name, t in tensors.items():
        for old, new in (("model.language_model.", "model."), ("language_model.model.", "model."),
                         ("language_model.lm_head.", "lm_head.")):
            if name.startswith(old):
                name = new + name[len(old):]
        if name.startswith(_VISION):
            continue
        if name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
            q, gate = split_query_gate(t, config.num_heads, config.head_dim)
            out[name] = q
            out[name.replace("q_proj", "gate_proj")] = gate
            continue
        out[name] = t
    gated = {n: t for n, t in out.items() if ".linear_attn." in n}
    out = {**add_one_to_norms({n: t for n, t in out.items() if n not in gated}, _NORMS), **gated}
    return stack_experts(out, config) if config.num_experts else out


def mtp_from_hf(tensors: Tensors, config: ModelConfig) -> Tensors:
    """The MTP layer's tensors (mtp.fc, its two input norms, mtp.layers.0.* a full-attention layer named
    as the model's, mtp.norm) in the forms the model's take, named model.*; config: its one-layer config."""
    renamed = {"model." + n.removeprefix("mtp."): t for n, t in tensors.items() if n.startswith("mtp.")}
    return add_one_to_norms(from_hf(renamed, config), ("pre_fc_norm_embedding", "pre_fc_norm_hidden"))


def split_query_gate(t: torch.Tensor, heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q_proj's rows (weight or bias) hold each head's query then its gate: [heads x (query, gate) x head_dim]."""
    rest = tuple(t.shape[1:])
    per_head = t.reshape(heads, 2, head_dim, *rest)
    return per_head[:, 0].reshape(heads * head_dim, *rest), per_head[:, 1].reshape(heads * head_dim, *rest)


QWEN3_5 = Family("qwen3_5", Qwen3_5ForCausalLM, qwen3_5_config,
                 ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration",
                  "Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"), ("qwen35", "qwen35moe"), from_hf,
                 mtp_from_hf=mtp_from_hf)
