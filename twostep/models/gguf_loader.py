"""Read a GGUF file into what a HF checkpoint folder would give us.

`load_gguf(path, dtype)` returns a `GGUFCheckpoint`: a HF-style config dict that the family's config
reader (models/families/) understands, the weights under HF parameter names and in the form the
family's model loads (what the family's `from_hf` makes of a HF checkpoint; loader.py does not call it
for a GGUF file), matrices of Q8_0, Q4_0/1, Q5_0/1, Q4_K, Q5_K and Q6_K kept packed as
QuantizedWeight (quantization/gguf_blocks.py; other types, and every type with keep_quantized=False,
dequantised to float32 and cast to `dtype`), a `tokenizers.Tokenizer` built from the vocabulary
stored in the file, and tokenizer / generation settings.

Architectures (`general.architecture`, as llama.cpp's convert_hf_to_gguf.py writes them): llama
(Mistral and SmolLM2 files are llama too; with experts, Mixtral), qwen2, qwen3, qwen3moe, smollm3,
granite, olmo2, olmoe, phi3, gemma2, gemma3, glm4, gpt-oss, and the hybrids qwen35, qwen35moe (Qwen3.5
dense and MoE) and qwen3next, one row each of `_ARCHITECTURES`: the
tensors a layer has, how the file's tensors differ from the HF checkpoint's, and the metadata keys
that become HF config keys. Experts are stacked tensors [E, n, k] per projection (`ffn_*_exps`, or a
merged `ffn_gate_up_exps` cut per expert), loaded as the MoE block's [E * n, k] (layers/moe.py),
packed where their type is; a layer with a router (`ffn_gate_inp`) routes to them, beside a shared
expert where the layer has one (`ffn_*_shexp`, its gate `ffn_gate_inp_shexp`). Blocks past
block_count - nextn_predict_layers are multi-token prediction layers (Qwen3.5's MTP), not loaded.
What llama.cpp's converter does to them that matters here:

* Q/K rows. llama.cpp rotates adjacent pairs of a head's dims (rope type NORM) for llama, smollm3,
  granite and glm4, and the two halves of the head (NEOX, HF's rotate_half) for the others. The
  converter permutes the Q/K rows (weights and biases) of llama, smollm3 and granite files from HF's
  halves to pairs: undone here. GLM-4's checkpoint itself rotates interleaved pairs, so its file has
  HF's rows, which are reordered from pairs to halves within each head's rotary dims as the glm4
  family does for a HF checkpoint (`pairs_to_halves`).
* Fused projections. phi3 files keep the checkpoint's fused q/k/v (`attn_qkv`) and gate/up (`ffn_up`,
  gate rows first), glm4 files its gate/up, and a file of any architecture may fuse q/k/v (the
  converter's --fuse-qkv): they are cut into q/k/v and gate/up rows (packed weights stay packed).
* Norms. The converter folds Gemma's RMSNorm (1 + w) into the weights (norms, q/k norms, final
  norm): they are used as they are. `ffn_norm` is the norm in front of the MLP: HF's
  post_attention_layernorm in pre-norm layers, pre_feedforward_layernorm in the sandwich layers of
  Gemma and GLM-4, where `post_attention_norm` (HF's post_attention_layernorm, GLM-4's
  post_self_attn_layernorm) norms attention's output.
* What the file does not store, llama.cpp derives, and so does this loader: Gemma's query scale
  (1/sqrt(head size); for the 27B models, 46 and 62 layers, 1/sqrt(hidden / heads)), whatever
  query_pre_attn_scalar the checkpoint had; Gemma's sliding layers from
  `attention.sliding_window_pattern`, a period (default 2 for Gemma 2, 6 for Gemma 3: every n-th
  layer full) or a per-layer list; Gemma 2's soft-caps where absent (50 and 30); SmolLM3's layers
  without RoPE (every 4th, whatever no_rope_layers the checkpoint had).
* Phi-3's LongRoPE factors are tensors (rope_factors_short/long), its original context and
  attention factor metadata keys. Gemma 3 files drop the embedding rows past the tokenizer's real
  vocabulary: the model's vocab_size is the embedding's row count, not the token list's length.
* The hybrids (models/families/qwen3_5.py, qwen3_next.py): `attention.recurrent_layers` (else every
  `full_attention_interval`-th layer full) says which layers are Gated DeltaNet ones, whose tensors
  (attn_qkv, attn_gate, ssm_*) become linear_attn's; the ssm.* keys give its heads (group_count key
  heads of state_size dims, time_step_rank value heads sharing inner_size). The file stores A_log as
  ssm_a = -exp(A_log) and the convolution [C, K] squeezed: undone. Its norms carry 1 + w already,
  the gated norm (ssm_norm) w, as the family's model takes them. attn_q keeps each head's query and
  output gate together: cut into q_proj and gate_proj; Qwen3-Next's ssm_ba holds each key head's b
  then a: cut into in_proj_b and in_proj_a. Qwen3.5's converter tiles the value heads over the key
  heads (llama.cpp repeats q/k whole); HF groups them: the rows of qkv's values, z, b, a, the conv
  channels, dt and A, and out_proj's columns, are put back in HF's order. Packed rows move freely;
  packed columns only as whole blocks and scale groups, so out_proj stays packed for value heads of
  a multiple of 32 dims (the real models': 128) and is dequantized for narrower ones. The M-RoPE
  sections Qwen3.5 files carry rotate text positions as plain RoPE does: not read.

Choices worth knowing:

* BOS. `tokenizer_config["add_bos_token"]` says whether the model expects a BOS token in front of
  every prompt: the file's `tokenizer.ggml.add_bos_token` when present, otherwise True for a
  sentencepiece ("llama") vocabulary and False for any other. Those are llama.cpp's defaults and
  what transformers' GGUF tokenizer does. The returned tokenizer's post-processor already applies
  that flag (and `add_eos_token`), so `tokenizer.encode(text, add_special_tokens=True)` gives the
  same ids as HF's tokenizer for the model, and a caller that prepends BOS itself when
  `add_bos_token` is true must first check the post-processor did not already do it.
* Special-token ids outside the vocabulary (stories260K.gguf declares padding id 0xFFFFFFFF, llama.cpp's
  "none") are treated as absent.
* Llama 3.x files carry their rope scaling as a `rope_freqs.weight` tensor of per-frequency factors
  (llama.cpp divides each inverse frequency by its factor); it is returned in hf_config as
  `rope_freq_factors`, which the decoder applies the same way.
* Refused by name rather than run wrongly: an architecture not listed, a tensor the architecture
  does not have, partial RoPE where the architecture has none, OLMo files with sliding windows
  (OLMo 3) and GLM-4 files with M-RoPE sections (its vision models).
"""
from __future__ import annotations

import logging
import os
import re
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QType
from tokenizers import Tokenizer

from twostep.models import gguf_derived as derived
from twostep.models.config import LINEAR
from twostep.models.families.glm4 import pairs_to_halves
from twostep.models.family import split_rows
from twostep.models.gguf_file import REQUIRED, GGUFFile
from twostep.models.gguf_file import metadata_field as _field
from twostep.models.gguf_tokenizer import build_tokenizer
from twostep.models.gguf_value_heads import untiled_columns, value_head_rows
from twostep.models.registry import gguf_families
from twostep.quantization.gguf_blocks import PACKED_TYPES, pack_gguf
from twostep.quantization.packed import QuantizedWeight

logger = logging.getLogger(__name__)

# Every type gguf.quants can dequantise that llama files commonly use. F32/F16/BF16/Q8_0/Q4_0/Q4_1 are
# the required set; the Q5 and K-quants come for free from the same gguf.quants call.
SUPPORTED_TENSOR_TYPES = (
    QType.F32, QType.F16, QType.BF16, QType.Q8_0, QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1,
    QType.Q2_K, QType.Q3_K, QType.Q4_K, QType.Q5_K, QType.Q6_K, QType.MXFP4,
)

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Tensors that are settings, not weights: read into the config (_hf_config).
_CONFIG_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")

# llama.cpp's block tensor -> the HF module; an architecture's `names` overrides a row.
_BLOCK_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",           # fused: cut into q/k/v (_FUSED)
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",  # on attention's output (sandwich, post-norm)
    "ffn_norm": "post_attention_layernorm",     # in front of the MLP: a pre-norm layer's second norm
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",                 # the router
    "ffn_gate_exps": "mlp.experts.gate_proj",   # [E, I, H]: every expert's, stacked (layers/moe.py)
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_up_exps": "mlp.experts.gate_up_proj",     # merged by some converters: cut per expert
    "attn_sinks": "self_attn.sinks",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",    # the shared expert beside the routed ones
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",     # [1, H]: its output's sigmoid gate
}
# Parameters of a module rather than a module's weight or bias: named without the kind.
_PARAMETERS = ("self_attn.sinks", "linear_attn.dt_bias", "linear_attn.A_log")
# Fused HF modules -> the projections they stack, in row order.
_FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.experts.gate_up_proj": ("mlp.experts.gate_proj", "mlp.experts.up_proj"),    # expert by expert
    # Qwen3.5 / Qwen3-Next: q_proj's rows hold each head's query then its output gate (head by head);
    # the converter's --fuse-qkv stacks those with k and v
    "self_attn.q_gate_proj": ("self_attn.q_proj", "self_attn.gate_proj"),
    "self_attn.q_gate_kv_proj": ("self_attn.q_gate_proj", "self_attn.k_proj", "self_attn.v_proj"),
    # Qwen3-Next's in_proj_ba: each key head's value heads' b, then their a (key head by key head)
    "linear_attn.in_proj_ba": ("linear_attn.in_proj_b", "linear_attn.in_proj_a"),
}
# Fused modules whose parts alternate in groups (config key of the group count), not one after the other.
_GROUPS = {"mlp.experts.gate_up_proj": "num_experts", "self_attn.q_gate_proj": "num_attention_heads",
           "linear_attn.in_proj_ba": "linear_num_key_heads"}
_BLOCK_TENSOR_NAME = re.compile(r"blk\.(\d+)\.(\w+)(?:\.(weight|bias))?")    # ssm_a: no kind
_BLOCK_INDEX = re.compile(r"blk\.(\d+)\.")
_ROUTER = re.compile(r"blk\.(\d+)\.ffn_gate_inp\.weight")
_ATTENTION_BIAS = re.compile(r"blk\.\d+\.attn_(q|qkv)\.bias")


def _weights(*modules: str) -> tuple[str, ...]:
    return tuple(f"{m}.weight" for m in modules)


_ATTENTION = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
_MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
_MOE = ("mlp.gate", "mlp.experts.gate_proj", "mlp.experts.up_proj", "mlp.experts.down_proj")
_QK_NORMS = ("self_attn.q_norm", "self_attn.k_norm")
_PRE_NORM = _weights(*_ATTENTION, *_MLP, "input_layernorm", "post_attention_layernorm")
_SANDWICH = _weights(*_ATTENTION, *_MLP, "input_layernorm", "post_attention_layernorm",
                     "pre_feedforward_layernorm", "post_feedforward_layernorm")
_QKV_BIAS = tuple(f"self_attn.{p}_proj.bias" for p in "qkv")
_ALL_BIAS = _QKV_BIAS + ("self_attn.o_proj.bias",)      # Llama-style attention_bias: q, k, v and o


@dataclass(frozen=True)
class _Architecture:
    """How the files of one GGUF architecture map onto a HF checkpoint of its family."""

    layer: tuple[str, ...]              # every layer's tensors: HF names (module.kind) after unfusing
    optional: tuple[str, ...] = ()      # attention biases (attention_bias in the config): all or none
    names: Mapping[str, str] = field(default_factory=dict)     # block tensor -> HF module, over _BLOCK_TENSORS
    # Q/K rows: "permuted" by the converter from HF's halves to pairs (undone); "pairs" in the
    # checkpoint itself (GLM-4: reordered to halves); None: halves, as HF's
    rotary_rows: str | None = None
    partial_rotary: bool = False        # RoPE may cover the first dims of a head only
    metadata: Mapping[str, str] = field(default_factory=dict)  # key after "{arch}." -> HF config key
    defaults: Mapping[str, Any] = field(default_factory=dict)  # HF config values no key overrides
    # (meta, config so far) -> config entries llama.cpp derives rather than reads; ValueError: refused
    derive: Callable[[Callable[..., Any], dict], dict] | None = None
    moe: tuple[str, ...] = ()           # a MoE layer's tensors besides the router's and experts' weights
    renormalise: bool = True            # llama.cpp renormalises the chosen experts' weights (not OLMoE's)
    # hybrids: a linear-attention layer's tensors (layer_types LINEAR) and its block tensor -> HF
    # module (over `names`: attn_qkv is the linear attention's in those layers, attention's in the others)
    linear_layer: tuple[str, ...] = ()
    linear_names: Mapping[str, str] = field(default_factory=dict)
    tiled_value_heads: bool = False     # Qwen3.5's value heads tiled over the key heads (undone)


_PERMUTED = {"optional": _ALL_BIAS, "rotary_rows": "permuted"}     # llama.cpp's converter's LlamaModel
# Qwen3.5 / Qwen3-Next: gated full attention in some layers, Gated DeltaNet in the others
_GATED_ATTENTION = _weights(*_ATTENTION, "self_attn.gate_proj", *_QK_NORMS)
_GATED_DELTANET = _weights(*(f"linear_attn.{m}" for m in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a",
                                                           "conv1d", "norm", "out_proj"))) + ("linear_attn.dt_bias", "linear_attn.A_log")
_HYBRID_NORMS = _weights("input_layernorm", "post_attention_layernorm")
_SHARED_EXPERT = _weights("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj", "mlp.shared_expert.down_proj",
                          "mlp.shared_expert_gate")
_HYBRID = {
    "layer": _GATED_ATTENTION + _weights(*_MLP) + _HYBRID_NORMS,
    "linear_layer": _GATED_DELTANET + _weights(*_MLP) + _HYBRID_NORMS,
    # q_proj's rows: each head's query, then its gate
    "names": {"attn_q": "self_attn.q_gate_proj", "attn_qkv": "self_attn.q_gate_kv_proj"},
    "linear_names": {"attn_qkv": "linear_attn.in_proj_qkv", "attn_gate": "linear_attn.in_proj_z",
                     "ssm_beta": "linear_attn.in_proj_b", "ssm_alpha": "linear_attn.in_proj_a",
                     "ssm_ba": "linear_attn.in_proj_ba", "ssm_conv1d": "linear_attn.conv1d",
                     "ssm_dt": "linear_attn.dt_bias", "ssm_a": "linear_attn.A_log", "ssm_norm": "linear_attn.norm",
                     "ssm_out": "linear_attn.out_proj"},
    "moe": _SHARED_EXPERT, "partial_rotary": True, "derive": derived.hybrid,
}
_GEMMA_NORMS = {"ffn_norm": "pre_feedforward_layernorm"}
_GELU = {"hidden_act": "gelu_pytorch_tanh"}
_ARCHITECTURES = {
    "llama": _Architecture(_PRE_NORM, **_PERMUTED),
    "qwen2": _Architecture(_PRE_NORM + _QKV_BIAS),
    "qwen3": _Architecture(_PRE_NORM + _weights(*_QK_NORMS), optional=_ALL_BIAS),
    "qwen3moe": _Architecture(_PRE_NORM + _weights(*_QK_NORMS), optional=_ALL_BIAS),
    "olmoe": _Architecture(_PRE_NORM + _weights(*_QK_NORMS), optional=_ALL_BIAS, renormalise=False),
    "smollm3": _Architecture(_PRE_NORM, **_PERMUTED, derive=derived.smollm3),
    "granite": _Architecture(_PRE_NORM, **_PERMUTED, metadata={
        "attention.scale": "attention_multiplier", "embedding_scale": "embedding_multiplier",
        "residual_scale": "residual_multiplier", "logit_scale": "logits_scaling"}),
    "olmo2": _Architecture(_weights(*_ATTENTION, *_MLP, *_QK_NORMS, "post_attention_layernorm",
                                    "post_feedforward_layernorm"), optional=_ALL_BIAS, derive=derived.olmo2),
    "phi3": _Architecture(_PRE_NORM, names={"ffn_up": "mlp.gate_up_proj"}, partial_rotary=True, derive=derived.phi3),
    "gemma2": _Architecture(
        _SANDWICH, names=_GEMMA_NORMS, derive=derived.gemma(2, 46),
        metadata={"attn_logit_softcapping": "attn_logit_softcapping",
                  "final_logit_softcapping": "final_logit_softcapping", "attention.sliding_window": "sliding_window"},
        defaults={**_GELU, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "sliding_window": 4096}),
    "gemma3": _Architecture(
        _SANDWICH + _weights(*_QK_NORMS), names=_GEMMA_NORMS, derive=derived.gemma(6, 62),
        metadata={"final_logit_softcapping": "final_logit_softcapping", "attention.sliding_window": "sliding_window",
                  "rope.freq_base_swa": "rope_local_base_freq"},
        defaults={**_GELU, "rope_local_base_freq": 10000.0}),
    "gpt-oss": _Architecture(
        _weights(*_ATTENTION, "input_layernorm", "post_attention_layernorm") + _ALL_BIAS + ("self_attn.sinks",),
        moe=("mlp.gate.bias", "mlp.experts.gate_proj.bias", "mlp.experts.up_proj.bias", "mlp.experts.down_proj.bias"),
        metadata={"attention.sliding_window": "sliding_window"}, derive=derived.gpt_oss),
    "glm4": _Architecture(_SANDWICH, optional=_QKV_BIAS, rotary_rows="pairs", partial_rotary=True,
                          names={**_GEMMA_NORMS, "ffn_up": "mlp.gate_up_proj"}, derive=derived.glm4),
    "qwen35": _Architecture(**_HYBRID, tiled_value_heads=True),
    "qwen35moe": _Architecture(**_HYBRID, tiled_value_heads=True,
                               defaults={"architectures": ["Qwen3_5MoeForCausalLM"]}),
    "qwen3next": _Architecture(**_HYBRID),
}
SUPPORTED_ARCHITECTURES = tuple(_ARCHITECTURES)

# llama.cpp's special-token keys -> our names. eot/eom are end-of-turn markers (Llama 3's <|eot_id|>)
# that generation must stop at as well as eos.
_SPECIAL_TOKEN_KEYS = {
    "bos": "tokenizer.ggml.bos_token_id",
    "eos": "tokenizer.ggml.eos_token_id",
    "unk": "tokenizer.ggml.unknown_token_id",
    "pad": "tokenizer.ggml.padding_token_id",
    "eot": "tokenizer.ggml.eot_token_id",
    "eom": "tokenizer.ggml.eom_token_id",
}

@dataclass
class GGUFCheckpoint:
    hf_config: dict
    tensors: dict[str, torch.Tensor | QuantizedWeight]
    tokenizer: Tokenizer
    tokenizer_config: dict
    generation_config: dict


def load_gguf(path: str | os.PathLike, dtype: torch.dtype = torch.float32,
              keep_quantized: bool = True) -> GGUFCheckpoint:
    """Load a GGUF file: HF config, HF-named weights (packed or in `dtype`), tokenizer and its settings."""
    path = os.fspath(path)
    reader = _open(path)
    _check_supported(reader, path)

    tokens = _field(reader, "tokenizer.ggml.tokens", path)
    special = _special_token_ids(reader, path, len(tokens))
    hf_config = _hf_config(reader, path, special)
    arch = _field(reader, "general.architecture", path)
    tensors = _load_tensors(reader, hf_config, dtype, path, arch, keep_quantized)
    tokenizer, tokenizer_config = build_tokenizer(reader, path, tokens, special)
    generation_config = _generation_config(special)

    types = sorted({t.tensor_type.name for t in reader.tensors})
    logger.info("loaded GGUF %s: architecture %s, %d layers, tensor types %s, %d tensors",
                os.path.basename(path), arch, hf_config["num_hidden_layers"], "/".join(types), len(tensors))
    return GGUFCheckpoint(hf_config, tensors, tokenizer, tokenizer_config, generation_config)


# ---------------------------------------------------------------------------------------------------
# metadata


def _open(path: str) -> GGUFFile:
    """The file's metadata and tensor table; a file that cannot be parsed (truncated, not GGUF) is
    named in the error."""
    if not os.path.isfile(path):
        raise ValueError(f"{path}: no such GGUF file")
    try:
        return GGUFFile(path)
    except (ValueError, OSError, IndexError, KeyError, struct.error, UnicodeDecodeError) as e:
        size = os.path.getsize(path) if os.path.isfile(path) else 0
        raise ValueError(f"{path}: not a readable GGUF file ({size:,} bytes; truncated or corrupt?): "
                         f"{type(e).__name__}: {e}") from None


def _check_supported(reader: GGUFFile, path: str) -> None:
    """Refuse up front, before any dequantising, what we cannot load correctly."""
    arch = _field(reader, "general.architecture", path)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported; "
                         f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    bad = sorted({f"{t.name} ({t.tensor_type.name})" for t in reader.tensors
                  if t.tensor_type not in SUPPORTED_TENSOR_TYPES})
    if bad:
        names = ", ".join(t.name for t in SUPPORTED_TENSOR_TYPES)
        raise ValueError(f"{path}: unsupported GGUF tensor types in {', '.join(bad[:3])}"
                         f"{' ...' if len(bad) > 3 else ''}; supported: {names}")


def _special_token_ids(reader: GGUFFile, path: str, vocab_size: int) -> dict[str, int | None]:
    """Special-token ids, None where absent. Out-of-range ids are llama.cpp's way of saying 'none'."""
    ids = {}
    for name, key in _SPECIAL_TOKEN_KEYS.items():
        value = _field(reader, key, path, default=None)
        ids[name] = value if value is not None and 0 <= value < vocab_size else None
    return ids


def _float32_value(value: float) -> float:
    """GGUF stores floats as float32; 1e-5 reads back as 9.99999974e-06. Take the shortest decimal
    that is the same float32, which is what the model's config.json held."""
    return float(str(np.float32(value)))


def _hf_config(reader: GGUFFile, path: str, special: dict[str, int | None]) -> dict:
    arch = _field(reader, "general.architecture", path)
    spec = _ARCHITECTURES[arch]

    def meta(key: str, default: Any = REQUIRED) -> Any:
        return _field(reader, f"{arch}.{key}", path, default)

    heads = meta("attention.head_count")
    hidden = meta("embedding_length")
    # llama.cpp's defaults: head size is hidden/heads unless stated, RoPE covers the whole head.
    head_dim = meta("attention.key_length", hidden // heads)
    rope_dim = meta("rope.dimension_count", head_dim)
    partial = rope_dim / head_dim
    if rope_dim != head_dim and not (spec.partial_rotary and 0 < rope_dim < head_dim and rope_dim % 2 == 0
                                     and int(head_dim * partial) == rope_dim):
        raise ValueError(f"{path}: partial rotary embeddings (rope dim {rope_dim} of head dim "
                         f"{head_dim}) are not supported for {arch}; supported: RoPE over the whole head"
                         f"{' or an even part of it' if spec.partial_rotary else ''}")
    embedding = _tensor_info(reader, "token_embd.weight", path)
    family = gguf_families()[arch]
    experts_size = meta("expert_feed_forward_length", None)     # a MoE file may name no dense MLP size
    config = {
        "architectures": [family.hf_architectures[0]],
        "model_type": family.name,
        "hidden_size": hidden,
        "intermediate_size": meta("feed_forward_length", REQUIRED if experts_size is None else experts_size),
        # the blocks past these are multi-token prediction's (llama.cpp's NextN layers): not loaded
        "num_hidden_layers": meta("block_count") - meta("nextn_predict_layers", 0),
        "num_attention_heads": heads,
        "num_key_value_heads": meta("attention.head_count_kv", heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "attention_bias": any(_ATTENTION_BIAS.fullmatch(t.name) for t in reader.tensors),
        "mlp_bias": False,
        "rms_norm_eps": _float32_value(meta("attention.layer_norm_rms_epsilon")),
        "rope_theta": _float32_value(meta("rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(reader, path, arch),
        "max_position_embeddings": meta("context_length"),
        # The embedding's row count (last in ggml's order), not the token list: the weights are what
        # the model is built from.
        "vocab_size": int(embedding.shape[-1]),
        "tie_word_embeddings": _tensor_info(reader, "output.weight", path, required=False) is None,
        "bos_token_id": special["bos"],
        "eos_token_id": special["eos"],
        "pad_token_id": special["pad"],
    }
    if meta("expert_count", 0):
        config |= _experts(reader, meta, config, arch, path)
    if spec.partial_rotary:     # always: GLM-4's reader takes half the head where the key is absent
        config["partial_rotary_factor"] = partial
    if (freq_factors := _config_tensor(reader, "rope_freqs.weight")) is not None:
        config["rope_freq_factors"] = freq_factors
    config |= spec.defaults
    for key, hf_key in spec.metadata.items():
        if (value := meta(key, None)) is not None:
            config[hf_key] = _float32_value(value) if isinstance(value, float) else value
    if spec.derive is not None:
        try:
            config |= spec.derive(meta, config)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
    return config


def _experts(reader: GGUFFile, meta: Callable[..., Any], config: dict, arch: str, path: str) -> dict:
    """A mixture of experts' settings (layers/moe.py), checked against its tensors: each layer with a
    router (ffn_gate_inp) routes to experts, the others are dense. llama.cpp renormalises the chosen
    experts' weights as the architecture does (Qwen3-MoE's norm_topk_prob, Mixtral's way; not
    OLMoE's), whatever the checkpoint said; a llama file with experts is Mixtral."""
    count, used = meta("expert_count"), meta("expert_used_count", 0)
    if not 0 < used <= count:
        raise ValueError(f"{path}: {arch}.expert_used_count is {used}; a token takes 1 to expert_count "
                         f"({count}) experts")
    for t in reader.tensors:
        experts = int(t.shape[-1]) if "_exps." in t.name or ".ffn_gate_inp." in t.name else count
        if experts != count:
            raise ValueError(f"{path}: tensor {t.name!r} holds {experts} experts; {arch}.expert_count says {count}")
    routed = {int(m[1]) for t in reader.tensors if (m := _ROUTER.fullmatch(t.name))}
    moe = {"num_experts": count, "num_experts_per_tok": used, "norm_topk_prob": _ARCHITECTURES[arch].renormalise,
           "moe_intermediate_size": meta("expert_feed_forward_length", config["intermediate_size"]),
           "mlp_only_layers": sorted(set(range(config["num_hidden_layers"])) - routed)}
    if arch == "llama":
        moe["architectures"] = ["MixtralForCausalLM"]
    return moe


def _config_tensor(reader: GGUFFile, name: str) -> list[float] | None:
    tensor = _tensor_info(reader, name, "", required=False)
    return None if tensor is None else [float(x) for x in _dequantize(tensor).flatten()]


def _rope_scaling(reader: GGUFFile, path: str, arch: str) -> dict | None:
    """HF rope_scaling from llama.cpp's rope.scaling.* keys (or the older rope.scale_linear), or
    LongRoPE from Phi-3's rope_factors_short/long tensors."""
    def meta(key: str, default: Any = REQUIRED) -> Any:
        return _field(reader, f"{arch}.rope.{key}", path, default)

    long, short = _config_tensor(reader, "rope_factors_long.weight"), _config_tensor(reader, "rope_factors_short.weight")
    if long is not None or short is not None:
        if long is None or short is None:
            raise ValueError(f"{path}: LongRoPE needs both rope_factors_long and rope_factors_short; "
                             f"the file has only one")
        scaling = {"rope_type": "longrope", "long_factor": long, "short_factor": short,
                   "original_max_position_embeddings": meta("scaling.original_context_length")}
        if (attention := meta("scaling.attn_factor", None)) is not None:   # else: from the context ratio
            scaling["attention_factor"] = _float32_value(attention)
        return scaling
    kind = meta("scaling.type", None)
    factor = meta("scaling.factor", None)
    if kind is None and (old_linear := meta("scale_linear", None)):
        kind, factor = "linear", old_linear
    if kind in (None, "none") or factor in (None, 0.0, 1.0):
        return None
    scaling = {"rope_type": kind, "factor": _float32_value(factor)}
    original = meta("scaling.original_context_length", None)
    if original:
        scaling["original_max_position_embeddings"] = original
    return scaling


def _generation_config(special: dict[str, int | None]) -> dict:
    stop_ids = list(dict.fromkeys(i for i in (special["eos"], special["eot"], special["eom"])
                                  if i is not None))
    eos = stop_ids[0] if len(stop_ids) == 1 else (stop_ids or None)
    return {"bos_token_id": special["bos"], "eos_token_id": eos}


# ---------------------------------------------------------------------------------------------------
# tensors


def _tensor_info(reader: GGUFFile, name: str, path: str, required: bool = True):
    for tensor in reader.tensors:
        if tensor.name == name:
            return tensor
    if required:
        raise ValueError(f"{path}: GGUF file has no tensor {name!r}")
    return None


def _is_linear_layer(config: dict, layer: int) -> bool:
    types = config.get("layer_types") or ()
    return layer < len(types) and types[layer] == LINEAR


def _hf_names(gguf_name: str, path: str, arch: str, config: dict) -> tuple[str, list[str]]:
    """The HF tensor a GGUF tensor is (a fused module's, where it is fused) and the HF tensors it
    holds: itself, or the parts of the fused projection in row order."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name], [_GLOBAL_TENSORS[gguf_name]]
    spec = _ARCHITECTURES[arch]
    match = _BLOCK_TENSOR_NAME.fullmatch(gguf_name)
    name, names, linear = "", [], False
    if match is not None:
        layer, part, kind = match.groups()
        linear = _is_linear_layer(config, int(layer))
        module = (spec.linear_names.get(part) if linear else None) or spec.names.get(part) or _BLOCK_TENSORS.get(part)
        if module in _PARAMETERS:       # a parameter of the module, not a module's weight
            name = f"model.layers.{layer}.{module}"
            names = [name]
        elif module is not None and kind is not None:
            name = f"model.layers.{layer}.{module}.{kind}"
            names = [f"model.layers.{layer}.{m}.{kind}" for m in _leaves(module)]
    allowed = set(spec.linear_layer if linear else spec.layer) | set(spec.optional) | set(_weights(*_MOE)) | set(spec.moe)
    if not names or any(n.split(".", 3)[3] not in allowed for n in names):
        # Loading around an unknown tensor would run a different model than the file describes.
        raise ValueError(f"{path}: unexpected tensor {gguf_name!r} for a {arch} GGUF")
    return name, names


def _leaves(module: str) -> list[str]:
    """The projections a (possibly fused, possibly twice) module holds, in row order."""
    return [leaf for part in _FUSED[module] for leaf in _leaves(part)] if module in _FUSED else [module]


def _projection_rows(module: str, config: dict) -> int:
    """How many rows a projection has (q, k, v, gate, up; every expert's gate, up; b, a)."""
    if module.startswith("mlp.experts."):
        return config["num_experts"] * config["moe_intermediate_size"]
    heads = {"self_attn.q_proj": config["num_attention_heads"], "self_attn.gate_proj": config["num_attention_heads"],
             "self_attn.q_gate_proj": 2 * config["num_attention_heads"],
             "self_attn.k_proj": config["num_key_value_heads"], "self_attn.v_proj": config["num_key_value_heads"]}
    if module in heads:
        return heads[module] * config["head_dim"]
    if module in ("linear_attn.in_proj_b", "linear_attn.in_proj_a"):
        return config["linear_num_value_heads"]
    return config["intermediate_size"]


def _unfused(weight: torch.Tensor | QuantizedWeight, name: str, config: dict,
             gguf_name: str, path: str) -> list[tuple[str, torch.Tensor | QuantizedWeight]]:
    """A fused tensor's parts, (HF name, rows) in row order: one after the other, or in turns where
    they alternate by group (_GROUPS: expert by expert, head by head); a part fused itself is cut
    again (--fuse-qkv's q holds Qwen3.5's gate)."""
    pieces = name.split(".", 3)
    module, _, kind = pieces[-1].rpartition(".")
    if len(pieces) < 4 or module not in _FUSED:
        return [(name, weight)]
    prefix, parts = ".".join(pieces[:3]), _FUSED[module]
    groups = config[_GROUPS[module]] if module in _GROUPS else 1
    sizes = [_projection_rows(part, config) for part in parts]
    rows = weight.n if isinstance(weight, QuantizedWeight) else weight.shape[0]
    if rows != sum(sizes) or any(size % groups for size in sizes):
        raise ValueError(f"{path}: tensor {gguf_name!r} has {rows} rows; its parts "
                         f"{', '.join(p.rsplit('.', 1)[-1] for p in parts)} have {sum(sizes)}")
    sizes = [size // groups for size in sizes]
    if groups == 1:
        cut = split_rows(weight, sizes)
    else:
        step, starts = sum(sizes), [sum(sizes[:i]) for i in range(len(sizes))]
        cut = [_take_rows(weight, torch.cat([torch.arange(g * step + start, g * step + start + size)
                                             for g in range(groups)])) for start, size in zip(starts, sizes)]
    return [leaf for part, rows in zip(parts, cut) for leaf in _unfused(rows, f"{prefix}.{part}.{kind}", config,
                                                                         gguf_name, path)]


def _take_rows(weight: torch.Tensor | QuantizedWeight, rows: torch.Tensor):
    return weight.rows(rows) if isinstance(weight, QuantizedWeight) else weight[rows]


def _rotary_row_order(name: str, rows: int, arch: str, config: dict) -> torch.Tensor | None:
    """The row order that gives q's or k's rows (weight or bias) the halves HF's rotary rotates;
    None: already so."""
    kind = _ARCHITECTURES[arch].rotary_rows
    if kind is None or name.rsplit(".", 2)[-2] not in ("q_proj", "k_proj"):
        return None
    head_dim = config["head_dim"]
    if kind == "pairs":
        return pairs_to_halves(rows, head_dim, int(head_dim * config.get("partial_rotary_factor", 1.0)))
    return _unpermute_rotary_rows(torch.arange(rows), rows // head_dim)


def _tiled(arch: str, config: dict) -> bool:
    return _ARCHITECTURES[arch].tiled_value_heads and config["linear_num_key_heads"] != config["linear_num_value_heads"]


def _shaped(name: str, t: torch.Tensor | QuantizedWeight) -> torch.Tensor | QuantizedWeight:
    """What llama.cpp's converter stores in another form: A_log as -exp(A_log), the convolution's
    [C, 1, K] squeezed, a shared expert gate [1, H] maybe as [H]."""
    if name.endswith("linear_attn.A_log"):
        return torch.log(-t)
    if name.endswith("linear_attn.conv1d.weight"):
        return t.reshape(t.shape[0], 1, -1)
    if name.endswith("mlp.shared_expert_gate.weight") and isinstance(t, torch.Tensor):
        return t.reshape(1, -1)
    return t


def _dequantize(tensor) -> torch.Tensor:
    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    # ggml lists dimensions fastest-moving first; torch wants them the other way round; experts
    # [E, n, k] are stacked as [E * n, k] (layers/moe.py)
    shape = tuple(int(d) for d in reversed(tensor.shape))
    if len(shape) == 3:
        shape = (shape[0] * shape[1], shape[2])
    # np.array copies: F32 data is a read-only view of the memory-mapped file.
    return torch.from_numpy(np.array(values, dtype=np.float32).reshape(shape))


def _unpermute_rotary_rows(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation.

    llama.cpp rotates adjacent pairs of each head's rows, so its converter interleaves the two halves
    HF's rotate_half works on (HF rows per head: x0..x{d/2-1}, y0..y{d/2-1}; GGUF: x0, y0, x1, y1, ...).
    """
    half = weight.shape[0] // n_heads // 2
    return weight.reshape(n_heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def _packed(tensor, path: str) -> QuantizedWeight:
    """A matrix, or experts [E, n, k] as the rows of one [E * n, k]."""
    k, n = int(tensor.shape[0]), int(np.prod([int(d) for d in tensor.shape[1:]]))
    try:
        return QuantizedWeight((pack_gguf(tensor.data, tensor.tensor_type, n, k),))
    except ValueError as e:
        raise ValueError(f"{path}: tensor {tensor.name!r}: {e}") from None


def _load_tensors(reader: GGUFFile, config: dict, dtype: torch.dtype,
                  path: str, arch: str, keep_quantized: bool) -> dict[str, torch.Tensor | QuantizedWeight]:
    tensors = {}
    for tensor in reader.tensors:
        if tensor.name in _CONFIG_TENSORS:      # read into the config
            continue
        if (block := _BLOCK_INDEX.match(tensor.name)) and int(block[1]) >= config["num_hidden_layers"]:
            continue                            # a multi-token prediction layer's (NextN)
        fused, _ = _hf_names(tensor.name, path, arch, config)
        packed = keep_quantized and tensor.tensor_type in PACKED_TYPES and len(tensor.shape) in (2, 3)
        weight = _packed(tensor, path) if packed else _dequantize(tensor)
        if "_exps.bias" in tensor.name:         # every expert's bias [E, n], as the experts' [E * n]
            weight = weight.reshape(-1)
        for name, part in _unfused(weight, fused, config, tensor.name, path):
            rows = part.n if isinstance(part, QuantizedWeight) else part.shape[0]
            order = _rotary_row_order(name, rows, arch, config)
            if order is None:
                order = value_head_rows(name, config) if _tiled(arch, config) else None
            if order is not None:
                part = _take_rows(part, order)
            if name.endswith("linear_attn.out_proj.weight") and _tiled(arch, config):
                part = untiled_columns(part, config)
            part = _shaped(name, part)
            tensors[name] = part if isinstance(part, QuantizedWeight) else part.to(dtype)
    _check_complete(tensors, config, path, arch)
    return tensors


def _check_complete(tensors: dict[str, torch.Tensor], config: dict, path: str, arch: str) -> None:
    spec = _ARCHITECTURES[arch]
    optional = spec.optional if config["attention_bias"] else ()
    dense = set(config.get("mlp_only_layers", ())) if config.get("num_experts") else set(range(config["num_hidden_layers"]))
    expected = {"model.embed_tokens.weight", "model.norm.weight"}
    for i in range(config["num_hidden_layers"]):
        layer = (spec.linear_layer if _is_linear_layer(config, i) else spec.layer + optional)
        if i not in dense:
            layer = tuple(t for t in layer if t not in _weights(*_MLP)) + _weights(*_MOE) + spec.moe
        expected |= {f"model.layers.{i}.{part}" for part in layer}
    missing = sorted(expected - tensors.keys())
    if missing:
        raise ValueError(f"{path}: GGUF file lacks tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}")
