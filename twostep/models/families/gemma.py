"""Gemma 2 and Gemma 3 (text): sandwich norms (each sub-layer's output normed again), RMSNorm
times (1 + w), GELU-tanh gating, embeddings times sqrt(hidden), query scale from
query_pre_attn_scalar, sliding-window layers between full ones (Gemma 2: every other; Gemma 3:
five of six, with their own RoPE base). Gemma 2 soft-caps attention scores and the logits;
Gemma 3 norms each q and k head instead. A Gemma3ForConditionalGeneration checkpoint loads its
text model; its vision tower is not loaded and images are not accepted."""
from __future__ import annotations

import math

from twostep.layers.decoder_layer import SandwichNormLayer
from twostep.models.causal_lm import CausalLM
from twostep.models.config import (SLIDING, ModelConfig, activation, base_config, rope_theta,
                                   sliding_window, window_layers)
from twostep.models.family import Family, Tensors, add_one_to_norms

_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
          "post_feedforward_layernorm", "q_norm", "k_norm", "norm")


class GemmaForCausalLM(CausalLM):
    layer = SandwichNormLayer


def _text(cfg: dict) -> dict:
    """A multimodal checkpoint keeps the language model's settings in text_config."""
    return {**cfg, **cfg["text_config"]} if "text_config" in cfg else cfg


def _common(cfg: dict, arch: str, pattern: int, **fields) -> ModelConfig:
    return base_config(
        cfg, arch, hidden_act=activation({"hidden_act": cfg.get("hidden_activation") or cfg.get("hidden_act")
                                          or "gelu_pytorch_tanh"}),
        embed_scale=math.sqrt(cfg["hidden_size"]),
        query_scale=float(cfg.get("query_pre_attn_scalar") or cfg.get("head_dim") or 256) ** -0.5,
        sliding_window=sliding_window(cfg, always=True),
        layer_types=window_layers(cfg, cfg["num_hidden_layers"], pattern),
        attn_softcap=cfg.get("attn_logit_softcapping"), final_softcap=cfg.get("final_logit_softcapping"),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)), **fields)


def gemma2_config(cfg: dict, arch: str) -> ModelConfig:
    return _common(cfg, arch, 2)


def gemma3_config(cfg: dict, arch: str) -> ModelConfig:
    text = _text(cfg)
    local = text.get("rope_local_base_freq") or rope_theta(text, SLIDING)
    return _common(text, arch, int(text.get("sliding_window_pattern", 6)), qk_norm="head",
                   rope_local_theta=float(local))


def from_hf(tensors: Tensors, config: ModelConfig) -> Tensors:
    renamed = {}
    for name, t in tensors.items():     # Gemma3ForConditionalGeneration's text model (transformers 4 and 5)
        for old, new in (("model.language_model.", "model."), ("language_model.model.", "model."),
                         ("language_model.lm_head.", "lm_head.")):
            if name.startswith(old):
                name = new + name[len(old):]
        if not name.startswith(("model.vision_tower.", "vision_tower.", "model.multi_modal_projector.",
                                "multi_modal_projector.")):
            renamed[name] = t
    return add_one_to_norms(renamed, _NORMS)


GEMMA2 = Family("gemma2", GemmaForCausalLM, gemma2_config, ("Gemma2ForCausalLM",), ("gemma2",), from_hf)
GEMMA3 = Family("gemma3", GemmaForCausalLM, gemma3_config,
                ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"), ("gemma3",), from_hf)
