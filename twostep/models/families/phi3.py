"""Phi-3, Phi-3.5, Phi-4 and Phi-4-mini: Llama's layers with q/k/v and gate/up fused in the
checkpoint, rotary over part of the head (Phi-4-mini: 3/4), LongRoPE, and a sliding window in
every layer where the config sets one."""
from __future__ import annotations

from twostep.models.causal_lm import CausalLM
from twostep.models.config import ModelConfig, base_config, sliding_window
from twostep.models.family import Family, Tensors, unfuse


class Phi3ForCausalLM(CausalLM):
    pass


def phi3_config(cfg: dict, arch: str) -> ModelConfig:
    return base_config(cfg, arch, sliding_window=sliding_window(cfg, always=True))


def from_hf(tensors: Tensors, config: ModelConfig) -> Tensors:
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    tensors = unfuse(tensors, "self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                     [q, kv, kv])
    ff = config.intermediate_size
    return unfuse(tensors, "mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj"), [ff, ff])


PHI3 = Family("phi3", Phi3ForCausalLM, phi3_config, ("Phi3ForCausalLM",), ("phi3",), from_hf)
