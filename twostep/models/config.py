"""A decoder's shape and its per-layer variants, read from a HF config.json by the model's family
(models/registry.py picks the family file, which reads its own keys with the helpers here)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from twostep.layers.rotary import RopeScaling

SUPPORTED_ROPE_SCALING = ("llama3", "linear", "yarn", "longrope", "dynamic")

FULL, SLIDING = "full_attention", "sliding_attention"
LINEAR = "linear_attention"         # a Gated DeltaNet layer (Qwen3.5, Qwen3-Next): a state, no K/V


@dataclass(slots=True, frozen=True)
class ModelConfig:
    """What every family's blocks read; a family sets the fields its blocks use."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False              # Qwen2 always; Llama/Qwen3/GLM-4 with attention_bias
    o_bias: bool = False                # Llama/Qwen3 with attention_bias
    qk_norm: str | None = None          # "head": RMSNorm per head (Qwen3, Gemma 3); "full": over all heads (OLMo 2)
    hidden_act: str = "silu"            # the gated MLP's: "silu" or "gelu_tanh" (Gemma)
    rope_scaling: RopeScaling | None = None
    rope_freq_factors: tuple[float, ...] | None = None   # GGUF llama3: inv_freq / factor
    rotary_dim: int | None = None       # None: the whole head; less: the first dims only (Phi-4-mini, GLM-4)
    rope_local_theta: float | None = None   # Gemma 3: sliding-window layers' base (unscaled)
    no_rope_layers: tuple[int, ...] = ()    # SmolLM3: layers without rotary embeddings
    # per layer FULL or SLIDING (None: every layer FULL, or every layer SLIDING where a window is set)
    layer_types: tuple[str, ...] | None = None
    sliding_window: int | None = None
    query_scale: float | None = None    # None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)
    attn_softcap: float | None = None   # Gemma 2
    final_softcap: float | None = None  # Gemma 2: on the logits
    embed_scale: float | None = None    # Gemma: sqrt(hidden); Granite: embedding_multiplier
    residual_scale: float | None = None     # Granite: each sub-layer's output times this
    logit_scale: float | None = None    # Granite: 1 / logits_scaling
    attn_sinks: bool = False            # gpt-oss: a learned logit per head joins each softmax
    # mixture of experts (layers/moe.py): 0 experts is a dense model
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0      # each expert's
    shared_expert_intermediate_size: int = 0    # Qwen2-MoE: an expert every token takes, gated (0: none)
    moe_layers: tuple[int, ...] | None = None   # which layers route to experts (None: all, where experts)
    # "softmax_topk": softmax over every expert, the top k kept (renormalised where norm_topk_prob:
    # Qwen3-MoE's flag, always for Mixtral); "topk_softmax": the top k logits, softmax over them (gpt-oss)
    router: str = "softmax_topk"
    norm_topk_prob: bool = False
    router_bias: bool = False           # gpt-oss
    expert_bias: bool = False           # gpt-oss: each expert's projections have biases
    swiglu_limit: float | None = None   # gpt-oss's clamped SwiGLU (hidden_act "swiglu_oai")
    swiglu_alpha: float = 1.702
    # linear attention (layers/gated_deltanet.py), in the layers layer_types marks LINEAR
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel: int = 4
    attn_output_gate: bool = False      # Qwen3.5 / Qwen3-Next: attention output times sigmoid(gate(x))
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0 and (self.moe_layers is None or layer in self.moe_layers)

    def layer_type(self, layer: int) -> str:
        if self.layer_types is not None:
            return self.layer_types[layer]
        return SLIDING if self.sliding_window is not None else FULL

    def window(self, layer: int) -> int | None:
        return self.sliding_window if self.layer_type(layer) == SLIDING else None

    def is_linear_layer(self, layer: int) -> bool:
        return self.layer_type(layer) == LINEAR

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """The layers that keep K/V (all but the linear-attention ones)."""
        return tuple(i for i in range(self.num_layers) if not self.is_linear_layer(i))

    @property
    def linear_layers(self) -> tuple[int, ...]:
        """The layers that keep a fixed-size state per sequence instead of K/V."""
        return tuple(i for i in range(self.num_layers) if self.is_linear_layer(i))

    @property
    def uniform_window(self) -> int | None:
        """The window where every layer has the same one (the KV manager then releases the blocks
        that fall out of it); None where any layer attends to everything."""
        windows = {self.window(i) for i in self.attention_layers}
        return windows.pop() if len(windows) == 1 else None

    @property
    def kv_group_windows(self) -> tuple[int | None, ...]:
        """Each KV-cache group's window (kv/kv_cache_manager.py): one group where every attention
        layer attends alike; else the full-attention layers first, then a group per window,
        narrowest first. Linear-attention layers keep no K/V and belong to none."""
        windows = {self.window(i) for i in self.attention_layers}
        if len(windows) == 1:
            return (windows.pop(),)
        return (None, *sorted(w for w in windows if w is not None))

    def kv_group(self, layer: int) -> int | None:
        """Which KV-cache group a layer's K/V belong to (None: a linear-attention layer's state)."""
        if self.is_linear_layer(layer):
            return None
        return self.kv_group_windows.index(self.window(layer)) if len(self.kv_group_windows) > 1 else 0

    @property
    def linear_conv_dim(self) -> int:
        """The channels a linear-attention layer's convolution runs over: q, k and v."""
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + \
            self.linear_num_value_heads * self.linear_value_head_dim

    def state_bytes(self, dtype_bytes: int) -> int:
        """One sequence's state over every linear-attention layer: the convolution's last
        kernel - 1 inputs (model dtype) and the recurrent matrix per value head (float32)."""
        conv = (self.linear_conv_kernel - 1) * self.linear_conv_dim * dtype_bytes
        recurrent = self.linear_num_value_heads * self.linear_key_head_dim * self.linear_value_head_dim * 4
        return len(self.linear_layers) * (conv + recurrent)

    def rope_kind(self, layer: int) -> str | None:
        """Which rotary tables a layer reads: "global", "local" (Gemma 3's sliding layers), None (NoPE)."""
        if layer in self.no_rope_layers:
            return None
        if self.rope_local_theta is not None and self.layer_type(layer) == SLIDING:
            return "local"
        return "global"

    @property
    def scale(self) -> float:
        return self.head_dim ** -0.5 if self.query_scale is None else self.query_scale

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V, every attention layer: 2 x layers x kv_heads x head_dim x dtype bytes."""
        return 2 * len(self.attention_layers) * self.num_kv_heads * self.head_dim * dtype_bytes

    def kv_bytes_at(self, context: int, dtype_bytes: int) -> int:
        """K/V one sequence of `context` tokens holds: a sliding-window layer keeps its window."""
        per_layer = 2 * self.num_kv_heads * self.head_dim * dtype_bytes
        return sum(per_layer * min(context, self.window(i) or context) for i in self.attention_layers)


# ---- reading a HF config.json: the helpers every family file uses ------------------------------

def base_config(cfg: dict[str, Any], architecture: str, **fields: Any) -> ModelConfig:
    """The fields every family reads the same way, plus the family's own."""
    heads = cfg["num_attention_heads"]
    hidden = cfg["hidden_size"]
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    head_dim = cfg.get("head_dim") or hidden // heads
    rope = rope_params(cfg)
    partial = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    common = dict(
        architecture=architecture,
        vocab_size=cfg["vocab_size"],
        hidden_size=hidden,
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta(cfg),
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        hidden_act=activation(cfg),
        rope_scaling=rope_scaling(cfg),
        rope_freq_factors=tuple(cfg["rope_freq_factors"]) if cfg.get("rope_freq_factors") else None,
        rotary_dim=None if partial == 1.0 else int(head_dim * partial),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
    )
    if cfg.get("mlp_bias"):
        raise ValueError("mlp_bias=true is not supported: twostep supports bias-free MLPs")
    return ModelConfig(**{**common, **fields})


def activation(cfg: dict[str, Any]) -> str:
    act = cfg.get("hidden_act") or cfg.get("hidden_activation") or "silu"
    if act in ("silu", "swish"):
        return "silu"
    if act in ("gelu_pytorch_tanh", "gelu_tanh"):
        return "gelu_tanh"
    raise ValueError(f"unsupported hidden_act {act!r}: twostep supports 'silu' and 'gelu_pytorch_tanh'")


def rope_params(cfg: dict[str, Any], kind: str | None = None) -> dict[str, Any]:
    """transformers 5 folds rope_theta and rope_scaling into "rope_parameters" (per layer kind for
    Gemma 3: {"full_attention": ..., "sliding_attention": ...}); 4.x keeps them apart."""
    params = cfg.get("rope_parameters") or {}
    if FULL in params or SLIDING in params:
        params = params.get(kind or FULL) or {}
    scaling = cfg.get("rope_scaling") or {}
    return {**scaling, **params}


def rope_theta(cfg: dict[str, Any], kind: str | None = None) -> float:
    return float(rope_params(cfg, kind).get("rope_theta") or cfg.get("rope_theta") or 10000.0)


def rope_scaling(cfg: dict[str, Any], kind: str | None = None) -> RopeScaling | None:
    p = rope_params(cfg, kind)
    name = p.get("rope_type") or p.get("type")
    if name in (None, "default"):
        return None
    if name == "su":                    # Phi-3's first checkpoints: LongRoPE by its older name
        name = "longrope"
    if name not in SUPPORTED_ROPE_SCALING:
        raise ValueError(
            f"unsupported rope_scaling type {name!r}: twostep supports "
            f"{', '.join(SUPPORTED_ROPE_SCALING)} (or none)"
        )
    max_positions = cfg.get("max_position_embeddings", 2048)
    original = int(p.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
                   or (8192 if name == "llama3" else max_positions))
    factor = p.get("factor")
    return RopeScaling(
        rope_type=name,
        factor=float(factor) if factor is not None else max_positions / original,
        low_freq_factor=float(p.get("low_freq_factor", 1.0)),
        high_freq_factor=float(p.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=original,
        max_position_embeddings=max_positions,
        attention_factor=None if p.get("attention_factor") is None else float(p["attention_factor"]),
        beta_fast=float(p.get("beta_fast") or 32.0),
        beta_slow=float(p.get("beta_slow") or 1.0),
        mscale=p.get("mscale"),
        mscale_all_dim=p.get("mscale_all_dim"),
        truncate=bool(p.get("truncate", True)),
        short_factor=tuple(p["short_factor"]) if p.get("short_factor") else None,
        long_factor=tuple(p["long_factor"]) if p.get("long_factor") else None,
    )


def window_layers(cfg: dict[str, Any], num_layers: int, pattern: int | None = None) -> tuple[str, ...] | None:
    """Each layer's kind from `layer_types`, else every `pattern`-th layer full (Gemma 2: 2, Gemma
    3: 6) and the others sliding."""
    types = cfg.get("layer_types")
    if types:
        odd = sorted({t for t in types if t not in (FULL, SLIDING)})
        if odd:
            raise ValueError(f"unsupported layer types {odd}: twostep supports {FULL} and {SLIDING}")
        return tuple(types)
    if pattern is None:
        return None
    return tuple(FULL if (i + 1) % pattern == 0 else SLIDING for i in range(num_layers))


def sliding_window(cfg: dict[str, Any], always: bool = False) -> int | None:
    """The window, where the family uses it: always (Mistral, Gemma), or where the config asks
    (Qwen2/3 carry a window they use only with use_sliding_window)."""
    window = cfg.get("sliding_window")
    if window is None or not (always or cfg.get("use_sliding_window")):
        return None
    return int(window)


def moe_layers(cfg: dict[str, Any]) -> tuple[int, ...]:
    """The layers routing to experts: every decoder_sparse_step-th one not in mlp_only_layers (Qwen's)."""
    step, dense = int(cfg.get("decoder_sparse_step") or 1), set(cfg.get("mlp_only_layers") or ())
    return tuple(i for i in range(cfg["num_hidden_layers"]) if (i + 1) % step == 0 and i not in dense)


def moe_fields(cfg: dict[str, Any]) -> dict[str, int]:
    """The experts' count (num_experts; num_local_experts in Mixtral's, gpt-oss's and transformers 5's
    configs), how many a token takes, and each one's intermediate size."""
    experts = cfg.get("num_experts") or cfg["num_local_experts"]
    return dict(num_experts=int(experts), num_experts_per_tok=int(cfg["num_experts_per_tok"]),
                moe_intermediate_size=int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]))
