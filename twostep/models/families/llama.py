"""Llama (1-3.x, SmolLM2, and every checkpoint saved as LlamaForCausalLM) and Mistral: pre-norm
layers, SwiGLU, RoPE with llama3/linear/YaRN/dynamic scaling; Mistral attends within its sliding
window in every layer."""
from __future__ import annotations

from twostep.models.causal_lm import CausalLM
from twostep.models.config import ModelConfig, base_config, sliding_window, window_layers
from twostep.models.family import Family


class LlamaForCausalLM(CausalLM):
    pass


def llama_config(cfg: dict, arch: str) -> ModelConfig:
    bias = bool(cfg.get("attention_bias", False))
    return base_config(cfg, arch, qkv_bias=bias, o_bias=bias)


def mistral_config(cfg: dict, arch: str) -> ModelConfig:
    return base_config(cfg, arch, sliding_window=sliding_window(cfg, always=True),
                       layer_types=window_layers(cfg, cfg["num_hidden_layers"]))


LLAMA = Family("llama", LlamaForCausalLM, llama_config, ("LlamaForCausalLM",), ("llama",))
MISTRAL = Family("mistral", LlamaForCausalLM, mistral_config, ("MistralForCausalLM",))
