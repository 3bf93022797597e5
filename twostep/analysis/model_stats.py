"""What the roofline needs to know of a model: N (parameters), b (bytes per weight) and k (KV bytes
per token), all from its config."""
from __future__ import annotations

from dataclasses import dataclass

from twostep.analysis.model_source import ModelSource
from twostep.analysis.number_formats import NumberFormat
from twostep.models.config import ModelConfig
from twostep.models.registry import config_from_hf, family_named


@dataclass(slots=True, frozen=True)
class ParamCounts:
    embedding: int
    lm_head: int        # the output projection's size, also when it is the embedding itself (tied)
    layers: int         # all decoder layers together
    final_norm: int
    tied: bool
    total: int          # what is stored: a tied head is counted once, inside the embedding


@dataclass(slots=True, frozen=True)
class KVStats:
    format: str
    bytes_per_value: int
    bytes_per_token: int        # k = 2 x layers x kv_heads x head_dim x dtype bytes
    mha_bytes_per_token: int    # the same if every query head had its own K and V
    attention: str              # MHA, GQA or MQA
    saving: float               # mha / k: how many times less KV grouping the heads stores
    windows: tuple[int | None, ...] = ()    # each layer's sliding window (None: full attention)

    def bytes_at(self, context: int) -> int:
        """One sequence's K/V at this context: a sliding-window layer holds only its window."""
        if not self.windows:
            return self.bytes_per_token * context
        per_layer = self.bytes_per_token // len(self.windows)
        return sum(per_layer * min(context, w or context) for w in self.windows)

    @property
    def windowed(self) -> bool:
        return any(self.windows)


@dataclass(slots=True, frozen=True)
class ModelStats:
    name: str
    architecture: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_context: int
    params: ParamCounts
    # N in the formulas: the stored parameter count (the reference text's definition, embeddings
    # included) unless the caller gives its own, e.g. the text's rounded 7.615e9.
    num_params: float
    weight_format: str
    bytes_per_weight: float     # b
    weight_bytes: float         # N x b
    kv: KVStats


def model_stats(source: ModelSource, weights: NumberFormat, kv: NumberFormat,
                num_params: float | None = None) -> ModelStats:
    cfg = config_from_hf(source.hf_config)
    params = count_params(cfg)
    n = params.total if num_params is None else num_params
    if n <= 0:
        raise ValueError(f"the parameter count must be positive, got {num_params}")
    return ModelStats(
        name=source.name, architecture=cfg.architecture, num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, vocab_size=cfg.vocab_size, max_context=cfg.max_position_embeddings,
        params=params, num_params=n, weight_format=weights.name, bytes_per_weight=weights.bytes,
        weight_bytes=n * weights.bytes, kv=kv_stats(cfg, kv),
    )


def count_params(cfg: ModelConfig) -> ParamCounts:
    embedding = cfg.vocab_size * cfg.hidden_size
    layers = cfg.num_layers * _layer_params(cfg)
    stored_head = 0 if cfg.tie_word_embeddings else embedding
    return ParamCounts(embedding=embedding, lm_head=embedding, layers=layers,
                       final_norm=cfg.hidden_size, tied=cfg.tie_word_embeddings,
                       total=embedding + stored_head + layers + cfg.hidden_size)


def _layer_params(cfg: ModelConfig) -> int:
    q = cfg.num_heads * cfg.head_dim
    kv = cfg.num_kv_heads * cfg.head_dim
    attention = cfg.hidden_size * (q + 2 * kv) + q * cfg.hidden_size   # q, k, v in; o out
    attention += (q + 2 * kv) if cfg.qkv_bias else 0
    attention += cfg.hidden_size if cfg.o_bias else 0
    if cfg.qk_norm == "head":                                           # Qwen3's, Gemma 3's per-head q/k norms
        attention += 2 * cfg.head_dim
    elif cfg.qk_norm == "full":                                         # OLMo 2's over all heads
        attention += q + kv
    mlp = 3 * cfg.hidden_size * cfg.intermediate_size                   # gated: gate, up, down
    return attention + mlp + _norms_per_layer(cfg) * cfg.hidden_size


def _norms_per_layer(cfg: ModelConfig) -> int:
    layer = family_named(cfg.architecture).model.layer
    return sum(1 for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                              "post_feedforward_layernorm") if name in layer.norm_names)


KV_SCALE_BYTES = 2


def kv_stats(cfg: ModelConfig, fmt: NumberFormat) -> KVStats:
    value_bytes = int(fmt.bytes)
    k = cfg.kv_bytes_per_token(value_bytes)
    if value_bytes == 1:   # twostep's 8-bit KV keeps a 2-byte scale per token and KV head
        k += 2 * cfg.num_layers * cfg.num_kv_heads * KV_SCALE_BYTES
    mha = k * cfg.num_heads // cfg.num_kv_heads
    kind = "MHA" if cfg.num_kv_heads == cfg.num_heads else "MQA" if cfg.num_kv_heads == 1 else "GQA"
    windows = tuple(cfg.window(i) for i in range(cfg.num_layers))
    return KVStats(format=fmt.name, bytes_per_value=value_bytes, bytes_per_token=k,
                   mha_bytes_per_token=mha, attention=kind,
                   saving=mha / k, windows=windows if any(windows) else ())
