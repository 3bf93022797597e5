"""The decoder's switches, read from a HF config.json and checked against what we support."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from twostep.layers.rotary import RopeScaling

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
SUPPORTED_ROPE_SCALING = ("llama3", "linear")


@dataclass(slots=True, frozen=True)
class ModelConfig:
    """One decoder, configured: the four supported families differ only in these fields."""

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
    qkv_bias: bool = False              # Qwen2 always; Llama/Qwen3 with attention_bias
    o_bias: bool = False                # Llama/Qwen3 with attention_bias
    qk_norm: bool = False               # Qwen3: RMSNorm on q and k per head
    rope_scaling: RopeScaling | None = None
    rope_freq_factors: tuple[float, ...] | None = None   # GGUF llama3: inv_freq / factor
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Mistral's window: attention is exactly full causal while the context stays within it,
    # so the engine caps max_model_len at it instead of implementing windowed attention.
    sliding_window: int | None = None

    @staticmethod
    def from_hf(cfg: dict[str, Any]) -> "ModelConfig":
        try:
            return ModelConfig._from_hf(cfg)
        except KeyError as e:
            raise ValueError(f"config.json lacks the field {e.args[0]!r}") from None

    @staticmethod
    def _from_hf(cfg: dict[str, Any]) -> "ModelConfig":
        arch = _architecture(cfg)
        _refuse_unsupported_features(cfg, arch)
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return ModelConfig(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(cfg),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=arch == "Qwen2ForCausalLM" or _attention_bias(cfg, arch),
            o_bias=_attention_bias(cfg, arch),
            qk_norm=arch == "Qwen3ForCausalLM",
            rope_scaling=_rope_scaling(cfg),
            rope_freq_factors=tuple(cfg["rope_freq_factors"]) if cfg.get("rope_freq_factors") else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            sliding_window=_sliding_window(cfg, arch),
        )

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V, every layer: 2 x layers x kv_heads x head_dim x dtype bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


def _attention_bias(cfg: dict[str, Any], arch: str) -> bool:
    # Llama and Qwen3 put a bias on q, k, v and o when attention_bias is set; Qwen2 has a
    # fixed q/k/v bias and none on o; Mistral has no such option.
    if arch in ("LlamaForCausalLM", "Qwen3ForCausalLM"):
        return bool(cfg.get("attention_bias", False))
    return False


def _architecture(cfg: dict[str, Any]) -> str:
    archs = cfg.get("architectures") or []
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return arch
    raise ValueError(
        f"unsupported model architecture {archs or cfg.get('model_type')!r}: "
        f"twostep supports {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def _rope_params(cfg: dict[str, Any]) -> dict[str, Any]:
    # transformers 5 folds rope_theta and rope_scaling into "rope_parameters"; 4.x keeps them apart.
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    return {**scaling, **params}


def _rope_theta(cfg: dict[str, Any]) -> float:
    return float(cfg.get("rope_theta") or _rope_params(cfg).get("rope_theta") or 10000.0)


def _rope_scaling(cfg: dict[str, Any]) -> RopeScaling | None:
    p = _rope_params(cfg)
    kind = p.get("rope_type") or p.get("type")
    if kind in (None, "default"):
        return None
    if kind not in SUPPORTED_ROPE_SCALING:
        raise ValueError(
            f"unsupported rope_scaling type {kind!r}: twostep supports "
            f"{', '.join(SUPPORTED_ROPE_SCALING)} (or none)"
        )
    return RopeScaling(
        rope_type=kind,
        factor=float(p["factor"]),
        low_freq_factor=float(p.get("low_freq_factor", 1.0)),
        high_freq_factor=float(p.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(p.get("original_max_position_embeddings", 8192)),
    )


def _sliding_window(cfg: dict[str, Any], arch: str) -> int | None:
    window = cfg.get("sliding_window")
    if window is None:
        return None
    if arch == "MistralForCausalLM" or cfg.get("use_sliding_window"):
        return int(window)
    return None  # Qwen2/3 carry a window in config but only use it with use_sliding_window


def _refuse_unsupported_features(cfg: dict[str, Any], arch: str) -> None:
    layer_types = cfg.get("layer_types") or []
    odd = sorted({t for t in layer_types if t != "full_attention"})
    if odd and (arch == "MistralForCausalLM" or cfg.get("use_sliding_window")):
        raise ValueError(
            f"per-layer attention types {odd} are not supported: twostep supports "
            "full causal attention in every layer"
        )
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"unsupported hidden_act {act!r}: twostep supports 'silu' (SwiGLU MLP)")
    if cfg.get("mlp_bias"):
        raise ValueError("mlp_bias=true is not supported: twostep supports bias-free MLPs")
