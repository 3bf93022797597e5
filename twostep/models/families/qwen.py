"""Qwen2 / Qwen2.5 (q/k/v biases) and Qwen3 (RMSNorm on each q and k head): Llama's layers;
a sliding window only where the config turns it on (use_sliding_window, per layer_types)."""
from __future__ import annotations

from twostep.models.causal_lm import CausalLM
from twostep.models.config import ModelConfig, base_config, sliding_window, window_layers
from twostep.models.family import Family


class QwenForCausalLM(CausalLM):
    pass


def _window(cfg: dict) -> dict:
    window = sliding_window(cfg)
    types = window_layers(cfg, cfg["num_hidden_layers"]) if window else None
    return dict(sliding_window=window, layer_types=types)


def qwen2_config(cfg: dict, arch: str) -> ModelConfig:
    return base_config(cfg, arch, qkv_bias=True, **_window(cfg))


def qwen3_config(cfg: dict, arch: str) -> ModelConfig:
    bias = bool(cfg.get("attention_bias", False))
    return base_config(cfg, arch, qkv_bias=bias, o_bias=bias, qk_norm="head", **_window(cfg))


QWEN2 = Family("qwen2", QwenForCausalLM, qwen2_config, ("Qwen2ForCausalLM",), ("qwen2",))
QWEN3 = Family("qwen3", QwenForCausalLM, qwen3_config, ("Qwen3ForCausalLM",), ("qwen3",))
