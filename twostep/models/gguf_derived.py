"""The config fields a GGUF file implies beyond its metadata's direct keys, one function per
architecture that needs it (models/gguf_loader.py's table names it as the row's `derive`): each takes
the metadata reader and the config so far and returns the fields to add."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from twostep.models.config import FULL, LINEAR, SLIDING


def sliding_layers(pattern: int | list, num_layers: int) -> list[bool]:
    """llama.cpp's `attention.sliding_window_pattern`: a per-layer list, or a period n (every n-th
    layer full, the others sliding; 0: all sliding)."""
    if isinstance(pattern, list):
        if len(pattern) != num_layers:
            raise ValueError(f"sliding_window_pattern has {len(pattern)} entries for {num_layers} layers")
        return [bool(p) for p in pattern]
    return [pattern == 0 or i % pattern < pattern - 1 for i in range(num_layers)]


def gemma(default_pattern: int, layers_of_27b: int) -> Callable[[Callable[..., Any], dict], dict]:
    def derive(meta: Callable[..., Any], cfg: dict) -> dict:
        layers, window = cfg["num_hidden_layers"], cfg.get("sliding_window") or None
        sliding = sliding_layers(meta("attention.sliding_window_pattern", default_pattern), layers) \
            if window else [False] * layers
        # the file has no query_pre_attn_scalar: llama.cpp scales by the head size, the 27B models
        # by hidden / heads (which is what their checkpoints say)
        big = layers == layers_of_27b
        return {"query_pre_attn_scalar": cfg["hidden_size"] // cfg["num_attention_heads"] if big else cfg["head_dim"],
                "sliding_window": window, "layer_types": [SLIDING if s else FULL for s in sliding]}
    return derive


def phi3(meta: Callable[..., Any], cfg: dict) -> dict:
    return {"sliding_window": meta("attention.sliding_window", 0) or None}     # 0: none


def smollm3(meta: Callable[..., Any], cfg: dict) -> dict:
    # llama.cpp's n_no_rope_layer_step, fixed at 4 (SmolLM3's own); no key holds it
    return {"no_rope_layers": [int((i + 1) % 4 != 0) for i in range(cfg["num_hidden_layers"])]}


def olmo2(meta: Callable[..., Any], cfg: dict) -> dict:
    if meta("attention.sliding_window", 0):
        raise ValueError("sliding-window attention (an OLMo 3 file) is not supported; supported: OLMo 2")
    return {}


def gpt_oss(meta: Callable[..., Any], cfg: dict) -> dict:
    """YaRN as gpt-oss's checkpoint has it (no truncation of the correction range); llama.cpp's clamp
    and alpha of the SwiGLU (no key holds them), every other layer windowed (its swa pattern 2)."""
    scaling = cfg.get("rope_scaling")
    if scaling is not None:
        scaling = {**scaling, "truncate": False, "beta_fast": meta("rope.scaling.yarn_beta_fast", 32.0),
                   "beta_slow": meta("rope.scaling.yarn_beta_slow", 1.0)}
    return {"rope_scaling": scaling, "swiglu_limit": 7.0, "swiglu_alpha": 1.702}


def hybrid(meta: Callable[..., Any], cfg: dict) -> dict:
    """Qwen3.5 / Qwen3-Next: the linear-attention layers (attention.recurrent_layers, else all but every
    full_attention_interval-th) and their shape from llama.cpp's ssm.* keys: group_count key heads of
    state_size dims, time_step_rank value heads sharing inner_size. RoPE's dimension_sections (M-RoPE)
    are the same rotation as a text model's for text positions: not read."""
    layers = cfg["num_hidden_layers"]
    recurrent = meta("attention.recurrent_layers", None)
    if recurrent is None:
        interval = meta("full_attention_interval", 4)
        recurrent = [(i + 1) % interval != 0 for i in range(layers)]
    if len(recurrent) < layers:
        raise ValueError(f"attention.recurrent_layers has {len(recurrent)} entries for {layers} layers")
    key_heads, value_heads, inner = meta("ssm.group_count"), meta("ssm.time_step_rank"), meta("ssm.inner_size")
    if not key_heads or value_heads % key_heads or inner % value_heads:
        raise ValueError(f"{value_heads} value heads of {inner} dims in all cannot share {key_heads} key heads")
    out = {"layer_types": [LINEAR if r else FULL for r in recurrent[:layers]],
           "linear_num_key_heads": key_heads, "linear_num_value_heads": value_heads,
           "linear_key_head_dim": meta("ssm.state_size"), "linear_value_head_dim": inner // value_heads,
           "linear_conv_kernel_dim": meta("ssm.conv_kernel")}
    if cfg.get("num_experts"):      # llama.cpp's default: the dense MLP's size
        out["shared_expert_intermediate_size"] = meta("expert_shared_feed_forward_length", cfg["intermediate_size"])
    return out


def glm4(meta: Callable[..., Any], cfg: dict) -> dict:
    if any(meta("rope.dimension_sections", [])):
        raise ValueError("M-RoPE sections (a GLM-4 vision model) are not supported; supported: GLM-4 text models")
    return {}
