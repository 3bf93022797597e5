"""What the roofline needs to know of a model: N (parameters), b (bytes per weight) and k (KV bytes
per token), all from its config.

A mixture-of-experts model (layers/moe.py) has two N: the total, every expert of every layer, which
is what memory holds, and the active count, what one token runs through (the experts it is routed
to, k of E in each MoE layer, in place of all E), which sets its FLOPs and, at batch 1, the weight
bytes decode reads per token. Both count the embedding and the head alike, as a dense model's N does
(and as the published figures do: Qwen3-30B-A3B's "30.5B total, 3.3B activated").

A hybrid model (Qwen3.5, Qwen3-Next: layer_types marks three of four layers "linear_attention") keeps
K/V in its attention layers only, so k counts those; each linear-attention (Gated DeltaNet) layer
keeps instead a state of fixed size per sequence, s in all (ModelConfig.state_bytes: the
convolution's last inputs in the model dtype, a float32 matrix per value head), which a decode step
reads and writes whatever the context. Its FLOPs per token are the projections' (in 2N' like every
weight's) plus the delta rule's recurrence (StateStats.flops_per_token), in place of the attention
scores that grow with the context."""
from __future__ import annotations

from dataclasses import dataclass

from twostep.analysis.model_source import ModelSource
from twostep.analysis.number_formats import NumberFormat, default_kv_format
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
    # what one token runs through: `total` less the experts it is not routed to (a dense model: total)
    active: int
    # mixture of experts (0 where dense): E, k, how many layers route, one expert's parameters (its
    # gate, up and down, and their biases), every expert of every layer, and the routers
    num_experts: int = 0
    experts_per_tok: int = 0
    moe_layers: int = 0
    expert: int = 0
    experts: int = 0
    routers: int = 0

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def experts_read(self, tokens: int) -> float:
        """How many distinct experts `tokens` tokens going through a MoE layer together take, expected:
        E (1 - (1 - k/E)^tokens), each token's k drawn uniformly and independently (k at 1 token, all E
        as the tokens grow). A real router's choices are neither, so it is an estimate; tokens of one
        sequence tend to share experts, which reads fewer."""
        if not self.is_moe:
            return 0.0
        e, k = self.num_experts, self.experts_per_tok
        return e * (1 - (1 - k / e) ** tokens)

    def params_read(self, tokens: int) -> float:
        """The parameters `tokens` tokens going through the model together read once: all of a dense
        model; a MoE model's without the experts none of them takes."""
        if not self.is_moe:
            return float(self.total)
        return self.total - self.experts + self.moe_layers * self.expert * self.experts_read(tokens)


@dataclass(slots=True, frozen=True)
class KVStats:
    format: str
    bytes_per_value: int
    bytes_per_token: int        # k = 2 x attention layers x kv_heads x head_dim x dtype bytes
    mha_bytes_per_token: int    # the same if every query head had its own K and V
    attention: str              # MHA, GQA or MQA
    saving: float               # mha / k: how many times less KV grouping the heads stores
    # each attention layer's sliding window (None: full attention); () where none has one
    windows: tuple[int | None, ...] = ()
    layers: int = 0             # the layers that keep K/V: all but a hybrid's linear-attention ones

    def bytes_at(self, context: int) -> int:
        """One sequence's K/V at this context: a sliding-window layer holds only its window."""
        if not self.windows:
            return self.bytes_per_token * context
        per_layer = self.bytes_per_token // len(self.windows)
        return sum(per_layer * min(context, w or context) for w in self.windows)

    @property
    def windowed(self) -> bool:
        return any(self.windows)


# The gated delta rule's FLOPs per token, value head and element of its Dk x Dv state, in the
# recurrent form decode runs: decay the state (1), read it with k (2: a multiply-add per element),
# add the rank-1 correction k (beta (v - S k))^T (2), read it with q for the output (2). The chunked
# form prefill runs does the same state work plus intra-chunk terms that grow with the chunk (64
# tokens), so for prefill this is a lower estimate, as the roofline's times are lower bounds.
DELTA_RULE_FLOPS = 7


@dataclass(slots=True, frozen=True)
class StateStats:
    """A hybrid model's linear-attention (Gated DeltaNet) layers and the state each sequence keeps
    in them, the same size at any context. No layers: a model whose every layer keeps K/V."""

    layers: int = 0             # linear-attention layers
    conv_kernel: int = 0        # the causal convolution's width: it keeps the last kernel - 1 inputs
    conv_dim: int = 0           # its channels: q, k and v
    conv_value_bytes: int = 0   # the model dtype's bytes: the convolution state's
    value_heads: int = 0
    key_head_dim: int = 0
    value_head_dim: int = 0
    recurrent_value_bytes: int = 4      # the recurrent state is float32 whatever the model dtype
    bytes_per_sequence: int = 0         # s: layers x (conv + recurrent), ModelConfig.state_bytes
    flops_per_token: int = 0            # the delta rule's, every layer: DELTA_RULE_FLOPS x Hv x Dk x Dv each

    @property
    def conv_bytes(self) -> int:
        """One layer's convolution state."""
        return (self.conv_kernel - 1) * self.conv_dim * self.conv_value_bytes

    @property
    def recurrent_bytes(self) -> int:
        """One layer's recurrent state: a Dk x Dv matrix per value head."""
        return self.value_heads * self.key_head_dim * self.value_head_dim * self.recurrent_value_bytes


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
    weight_bytes: float         # N x b: what memory holds (a MoE model: every expert)
    kv: KVStats
    # N' : what one token runs through, 2N' its FLOPs. A dense model's N; a MoE model's active count
    # (scaled with N where the caller gives N).
    active_params: float
    active_weight_bytes: float          # N' x b: the weights decode reads per token at batch 1
    state: StateStats = StateStats()    # a hybrid's linear-attention state (none: no such layers)

    @property
    def is_moe(self) -> bool:
        return self.params.is_moe

    @property
    def is_hybrid(self) -> bool:
        """Linear-attention layers beside the attention ones (a constant state per sequence)."""
        return self.state.layers > 0

    @property
    def flops_per_token(self) -> float:
        """F: 2N' (every weight a token runs through, one multiply-add each) plus a hybrid's delta
        rule. Attention's own FLOPs (scores and weighted values, growing with the context) are left
        out, as the reference text does."""
        return 2 * self.active_params + self.state.flops_per_token

    def sequence_bytes(self, context: int) -> int:
        """What one sequence of `context` tokens holds: its K/V and a hybrid's state."""
        return self.kv.bytes_at(context) + self.state.bytes_per_sequence

    def weight_bytes_read(self, tokens: int) -> float:
        """The weight bytes `tokens` tokens going through the model together read, once for all of
        them: N x b for a dense model; for a MoE model the experts they take, expected (experts_read),
        beside everything else, from N' x b at one token towards N x b."""
        if not self.is_moe:
            return self.weight_bytes
        return self.params.params_read(tokens) * self._scale * self.bytes_per_weight

    @property
    def _scale(self) -> float:
        """A given N over the counted one: the active and read counts scale with it."""
        return self.num_params / self.params.total


def model_stats(source: ModelSource, weights: NumberFormat, kv: NumberFormat,
                num_params: float | None = None) -> ModelStats:
    cfg = config_from_hf(source.hf_config)
    params = count_params(cfg)
    n = params.total if num_params is None else num_params
    if n <= 0:
        raise ValueError(f"the parameter count must be positive, got {num_params}")
    active = n if not params.is_moe else params.active * n / params.total
    return ModelStats(
        name=source.name, architecture=cfg.architecture, num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, vocab_size=cfg.vocab_size, max_context=cfg.max_position_embeddings,
        params=params, num_params=n, weight_format=weights.name, bytes_per_weight=weights.bytes,
        weight_bytes=n * weights.bytes, kv=kv_stats(cfg, kv), active_params=active,
        active_weight_bytes=active * weights.bytes,
        # the convolution state is kept in the type the engine computes in (bf16 for 8/4-bit weights)
        state=state_stats(cfg, int(default_kv_format(weights).bytes)),
    )


def count_params(cfg: ModelConfig) -> ParamCounts:
    embedding = cfg.vocab_size * cfg.hidden_size
    # each layer's token mixer: attention, or a hybrid's linear attention
    mixers = sum(_linear_attention_params(cfg) if cfg.is_linear_layer(i) else _attention_params(cfg)
                 for i in range(cfg.num_layers))
    norms = _norms_per_layer(cfg) * cfg.hidden_size
    moe = [i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)]
    dense_mlp = 3 * cfg.hidden_size * cfg.intermediate_size              # gated: gate, up, down
    expert = _expert_params(cfg) if moe else 0
    router = cfg.num_experts * cfg.hidden_size + (cfg.num_experts if cfg.router_bias else 0)
    # Qwen2-MoE's shared expert (every token runs it) and its gate count with the router
    if cfg.shared_expert_intermediate_size:
        router += 3 * cfg.hidden_size * cfg.shared_expert_intermediate_size + cfg.hidden_size
    experts, routers = len(moe) * cfg.num_experts * expert, len(moe) * router
    layers = mixers + cfg.num_layers * norms + (cfg.num_layers - len(moe)) * dense_mlp + routers + experts
    stored_head = 0 if cfg.tie_word_embeddings else embedding
    total = embedding + stored_head + layers + cfg.hidden_size
    # a token runs through its k experts of each MoE layer, not all E
    active = total - experts + len(moe) * cfg.num_experts_per_tok * expert
    return ParamCounts(embedding=embedding, lm_head=embedding, layers=layers,
                       final_norm=cfg.hidden_size, tied=cfg.tie_word_embeddings, total=total,
                       active=active, num_experts=cfg.num_experts if moe else 0,
                       experts_per_tok=cfg.num_experts_per_tok if moe else 0, moe_layers=len(moe),
                       expert=expert, experts=experts, routers=routers)


def _attention_params(cfg: ModelConfig) -> int:
    q = cfg.num_heads * cfg.head_dim
    kv = cfg.num_kv_heads * cfg.head_dim
    gate = q if cfg.attn_output_gate else 0                             # Qwen3.5's: a gate per query value
    attention = cfg.hidden_size * (q + gate + 2 * kv) + q * cfg.hidden_size   # q, (gate,) k, v in; o out
    attention += (q + gate + 2 * kv) if cfg.qkv_bias else 0
    attention += cfg.hidden_size if cfg.o_bias else 0
    if cfg.qk_norm == "head":                                           # Qwen3's, Gemma 3's per-head q/k norms
        attention += 2 * cfg.head_dim
    elif cfg.qk_norm == "full":                                         # OLMo 2's over all heads
        attention += q + kv
    attention += cfg.num_heads if cfg.attn_sinks else 0                 # gpt-oss: a sink logit per head
    return attention


def _linear_attention_params(cfg: ModelConfig) -> int:
    """A Gated DeltaNet layer (layers/gated_deltanet.py): in_proj_qkv, in_proj_z, in_proj_b and
    in_proj_a from the hidden state (Qwen3-Next's fused in_proj_qkvz and in_proj_ba are the same
    rows), the depthwise convolution, dt_bias and A_log per value head, the gated norm over a value
    head, out_proj back."""
    h, conv = cfg.hidden_size, cfg.linear_conv_dim
    value_dim, heads = cfg.linear_num_value_heads * cfg.linear_value_head_dim, cfg.linear_num_value_heads
    return (h * (conv + value_dim + 2 * heads) + conv * cfg.linear_conv_kernel + 2 * heads
            + cfg.linear_value_head_dim + value_dim * h)


def _expert_params(cfg: ModelConfig) -> int:
    """One expert's gated MLP: gate and up [moe_intermediate, hidden], down [hidden, moe_intermediate],
    with gpt-oss's biases."""
    h, i = cfg.hidden_size, cfg.moe_intermediate_size
    return 3 * h * i + ((2 * i + h) if cfg.expert_bias else 0)


def _norms_per_layer(cfg: ModelConfig) -> int:
    layer = family_named(cfg.architecture).model.layer
    return sum(1 for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                              "post_feedforward_layernorm") if name in layer.norm_names)


KV_SCALE_BYTES = 2


def kv_stats(cfg: ModelConfig, fmt: NumberFormat) -> KVStats:
    """k over the layers that keep K/V (a hybrid's attention layers only)."""
    value_bytes = int(fmt.bytes)
    layers = cfg.attention_layers
    k = cfg.kv_bytes_per_token(value_bytes)
    if value_bytes == 1:   # twostep's 8-bit KV keeps a 2-byte scale per token and KV head
        k += 2 * len(layers) * cfg.num_kv_heads * KV_SCALE_BYTES
    mha = k * cfg.num_heads // cfg.num_kv_heads
    kind = "MHA" if cfg.num_kv_heads == cfg.num_heads else "MQA" if cfg.num_kv_heads == 1 else "GQA"
    windows = tuple(cfg.window(i) for i in layers)
    return KVStats(format=fmt.name, bytes_per_value=value_bytes, bytes_per_token=k,
                   mha_bytes_per_token=mha, attention=kind, saving=mha / k if k else 1.0,
                   windows=windows if any(windows) else (), layers=len(layers))


def state_stats(cfg: ModelConfig, dtype_bytes: int) -> StateStats:
    """A hybrid's linear-attention state per sequence (none where every layer attends)."""
    layers = len(cfg.linear_layers)
    if not layers:
        return StateStats()
    heads, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    return StateStats(layers=layers, conv_kernel=cfg.linear_conv_kernel, conv_dim=cfg.linear_conv_dim,
                      conv_value_bytes=dtype_bytes, value_heads=heads, key_head_dim=dk, value_head_dim=dv,
                      bytes_per_sequence=cfg.state_bytes(dtype_bytes),
                      flops_per_token=layers * DELTA_RULE_FLOPS * heads * dk * dv)
