"""Read a llama, qwen2 or qwen3 GGUF file into what a HF checkpoint folder would give us.

`load_gguf(path, dtype)` returns a `GGUFCheckpoint`: a HF-style config dict, the weights under HF
parameter names (matrices of Q8_0, Q4_0/1, Q5_0/1, Q4_K, Q5_K and Q6_K kept packed as
QuantizedWeight, quantization/gguf_blocks.py; other types, and every type with
keep_quantized=False, dequantised to float32 and cast to `dtype`), a `tokenizers.Tokenizer` built
from the vocabulary stored in the file, and tokenizer / generation settings. Mistral and SmolLM
files are llama architecture; qwen2 adds q/k/v biases, qwen3 q/k RMSNorms (and an explicit head
size). llama.cpp's converter permutes the Q/K rows of llama files only (qwen rotates halves, as HF).

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
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import os
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QType
from tokenizers import AddedToken, Tokenizer, processors

from twostep.models.gguf_file import GGUFFile, StringArray
from twostep.quantization.gguf_blocks import PACKED_TYPES, pack_gguf
from twostep.quantization.packed import QuantizedWeight

logger = logging.getLogger(__name__)

# GGUF architecture -> (HF architecture, model_type)
_HF_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}
SUPPORTED_ARCHITECTURES = tuple(_HF_ARCHITECTURES)

# Every type gguf.quants can dequantise that llama files commonly use. F32/F16/BF16/Q8_0/Q4_0/Q4_1 are
# the required set; the Q5 and K-quants come for free from the same gguf.quants call.
SUPPORTED_TENSOR_TYPES = (
    QType.F32, QType.F16, QType.BF16, QType.Q8_0, QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1,
    QType.Q2_K, QType.Q3_K, QType.Q4_K, QType.Q5_K, QType.Q6_K,
)

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_norm": "input_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",       # qwen3
    "attn_k_norm": "self_attn.k_norm",
}
# The tensors each architecture's layers have: a file with others describes another model.
_LLAMA_LAYER = [f"{_BLOCK_TENSORS[part]}.weight" for part in (
    "attn_q", "attn_k", "attn_v", "attn_output", "attn_norm", "ffn_gate", "ffn_up", "ffn_down", "ffn_norm")]
_LAYER_TENSORS = {
    "llama": _LLAMA_LAYER,
    "qwen2": _LLAMA_LAYER + [f"self_attn.{p}_proj.bias" for p in "qkv"],
    "qwen3": _LLAMA_LAYER + ["self_attn.q_norm.weight", "self_attn.k_norm.weight"],
}
_BLOCK_TENSOR_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_SKIPPED_TENSORS = {"rope_freqs.weight"}

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

_REQUIRED = object()


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
    tokenizer, tokenizer_config = _build_tokenizer(reader, path, tokens, special)
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


def _field(reader: GGUFFile, key: str, path: str, default: Any = _REQUIRED) -> Any:
    """A metadata value as a Python object; a missing required key is a malformed file."""
    value = reader.fields.get(key)
    if value is not None:
        return value
    if default is _REQUIRED:
        raise ValueError(f"{path}: GGUF metadata lacks required key {key!r}")
    return default


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

    def meta(key: str, default: Any = _REQUIRED) -> Any:
        return _field(reader, f"{arch}.{key}", path, default)

    heads = meta("attention.head_count")
    hidden = meta("embedding_length")
    # llama.cpp's defaults: head size is hidden/heads unless stated, RoPE covers the whole head.
    head_dim = meta("attention.key_length", hidden // heads)
    rope_dim = meta("rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise ValueError(f"{path}: partial rotary embeddings (rope dim {rope_dim} of head dim "
                         f"{head_dim}) are not supported; supported: RoPE over the whole head")
    embedding = _tensor_info(reader, "token_embd.weight", path)
    hf_architecture, model_type = _HF_ARCHITECTURES[arch]
    return {
        "architectures": [hf_architecture],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": meta("feed_forward_length"),
        "num_hidden_layers": meta("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": meta("attention.head_count_kv", heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
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


def _rope_scaling(reader: GGUFFile, path: str, arch: str) -> dict | None:
    """HF rope_scaling from llama.cpp's rope.scaling.* keys (or the older rope.scale_linear)."""
    kind = _field(reader, f"{arch}.rope.scaling.type", path, None)
    factor = _field(reader, f"{arch}.rope.scaling.factor", path, None)
    if kind is None and (old_linear := _field(reader, f"{arch}.rope.scale_linear", path, None)):
        kind, factor = "linear", old_linear
    if kind in (None, "none") or factor in (None, 0.0, 1.0):
        return None
    scaling = {"rope_type": kind, "factor": _float32_value(factor)}
    original = _field(reader, f"{arch}.rope.scaling.original_context_length", path, None)
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


def _hf_name(gguf_name: str, path: str, arch: str) -> str:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    match = _BLOCK_TENSOR_NAME.fullmatch(gguf_name)
    name = None
    if match is not None and match.group(2) in _BLOCK_TENSORS:
        layer, part, kind = match.groups()
        name = f"model.layers.{layer}.{_BLOCK_TENSORS[part]}.{kind}"
    if name is None or name.split(".", 3)[3] not in _LAYER_TENSORS[arch]:
        # Loading around an unknown tensor would run a different model than the file describes.
        raise ValueError(f"{path}: unexpected tensor {gguf_name!r} for a {arch} GGUF")
    return name


def _dequantize(tensor) -> torch.Tensor:
    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    # ggml lists dimensions fastest-moving first; torch wants them the other way round.
    shape = tuple(int(d) for d in reversed(tensor.shape))
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
    n, k = (int(d) for d in reversed(tensor.shape))
    try:
        return QuantizedWeight((pack_gguf(tensor.data, tensor.tensor_type, n, k),))
    except ValueError as e:
        raise ValueError(f"{path}: tensor {tensor.name!r}: {e}") from None


def _load_tensors(reader: GGUFFile, config: dict, dtype: torch.dtype,
                  path: str, arch: str, keep_quantized: bool) -> dict[str, torch.Tensor | QuantizedWeight]:
    rotary_heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    if arch != "llama":
        rotary_heads = {}       # only llama files have their Q/K rows permuted
    tensors = {}
    for tensor in reader.tensors:
        if tensor.name in _SKIPPED_TENSORS:
            config["rope_freq_factors"] = [float(x) for x in _dequantize(tensor).flatten()]
            continue
        name = _hf_name(tensor.name, path, arch)
        packed = keep_quantized and tensor.tensor_type in PACKED_TYPES and len(tensor.shape) == 2
        weight = _packed(tensor, path) if packed else _dequantize(tensor)
        projection = name.split(".")[-2]
        if projection in rotary_heads and name.endswith(".weight"):
            if packed:
                order = _unpermute_rotary_rows(torch.arange(weight.n).unsqueeze(1), rotary_heads[projection])
                weight = weight.rows(order.squeeze(1))
            else:
                weight = _unpermute_rotary_rows(weight, rotary_heads[projection])
        tensors[name] = weight if packed else weight.to(dtype)
    _check_complete(tensors, config["num_hidden_layers"], path, arch)
    return tensors


def _check_complete(tensors: dict[str, torch.Tensor], num_layers: int, path: str, arch: str) -> None:
    expected = {"model.embed_tokens.weight", "model.norm.weight"}
    expected |= {f"model.layers.{i}.{part}" for i in range(num_layers) for part in _LAYER_TENSORS[arch]}
    missing = sorted(expected - tensors.keys())
    if missing:
        raise ValueError(f"{path}: GGUF file lacks tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}")


# ---------------------------------------------------------------------------------------------------
# tokenizer

_TOKENIZER_CACHE_FORMAT = 1     # bump when _build_tokenizer changes what it makes of the metadata


def _gguf_tokenizer_converter():
    """transformers' GGUF tokenizer conversion; it moved from integrations.ggml in transformers 5."""
    try:
        from transformers.integrations.gguf import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer
    except ImportError:
        from transformers.integrations.ggml import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer
    return GGUF_TOKENIZER_MAPPING["tokenizer"], convert_gguf_tokenizer


def _build_tokenizer(reader: GGUFFile, path: str, tokens: Sequence[str],
                     special: dict[str, int | None]) -> tuple[Tokenizer, dict]:
    strings = {name: None if special[name] is None else tokens[special[name]]
               for name in ("bos", "eos", "unk", "pad")}
    add_bos, add_eos = _add_bos_eos(reader, path, special)
    tokenizer_config = {
        "bos_token": strings["bos"],
        "eos_token": strings["eos"],
        "unk_token": strings["unk"],
        "pad_token": strings["pad"],
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "chat_template": _field(reader, "tokenizer.chat_template", path, None),
    }
    cache = _tokenizer_cache_file(reader)
    if cache is not None and cache.is_file():
        try:
            return Tokenizer.from_file(str(cache)), tokenizer_config
        except Exception:  # noqa: BLE001 - a damaged cache entry: convert again
            logger.warning("ignoring the unreadable cached tokenizer %s", cache)
    tokenizer = _convert_vocabulary(reader, path, special)
    # HF's tokenizer class registers these as special tokens on top of the vocabulary, so they are
    # matched whole in text and dropped by decode(skip_special_tokens=True); do the same.
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t in dict.fromkeys(strings.values()) if t is not None])
    bos = (strings["bos"], special["bos"]) if add_bos else None
    eos = (strings["eos"], special["eos"]) if add_eos else None
    tokenizer.post_processor = _special_token_template(bos, eos)
    if cache is not None:
        _save_atomically(tokenizer, cache)
    return tokenizer, tokenizer_config


def _tokenizer_cache_file(reader: GGUFFile) -> Path | None:
    """Where the tokenizer converted from this metadata is kept (the conversion imports transformers
    and takes seconds; reading it back, milliseconds): $TWOSTEP_CACHE_DIR, else
    $XDG_CACHE_HOME/twostep or ~/.cache/twostep, under a hash of the metadata and the versions of
    the libraries that convert it. None: caching switched off (TWOSTEP_CACHE_DIR="")."""
    root = os.environ.get("TWOSTEP_CACHE_DIR")
    if root == "":
        return None
    if root is None:
        root = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "twostep")
    versions = "-".join(_version(p) for p in ("transformers", "tokenizers"))
    key = hashlib.sha256(f"{reader.metadata_digest()} {versions} {_TOKENIZER_CACHE_FORMAT}".encode()).hexdigest()
    return Path(root) / "gguf-tokenizers" / f"{key[:32]}.json"


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "none"


def _save_atomically(tokenizer: Tokenizer, target: Path) -> None:
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(f".{os.getpid()}.tmp")
        tokenizer.save(str(partial))
        os.replace(partial, target)
    except OSError as e:                # a read-only home: convert every time
        logger.info("tokenizer not cached (%s)", e)


def _convert_vocabulary(reader: GGUFFile, path: str, special: dict[str, int | None]) -> Tokenizer:
    """transformers' conversion of the file's vocabulary (and merges) into a fast tokenizer."""
    key_names, convert = _gguf_tokenizer_converter()
    # The same metadata transformers' from_pretrained hands to the converter, except that the
    # out-of-range special ids are dropped: transformers' own reading of them crashes.
    tokenizer_dict = {name: _field(reader, f"tokenizer.{key}", path, None) for key, name in key_names.items()}
    tokenizer_dict = {name: list(value) if isinstance(value, StringArray) else value    # decoded, all
                      for name, value in tokenizer_dict.items()}
    tokenizer_dict = {name: value for name, value in tokenizer_dict.items()
                      if value is not None and not name.endswith("_token_id")}
    tokenizer_dict |= {f"{name}_token_id": special[name] for name in ("bos", "eos", "unk", "pad")
                       if special[name] is not None}
    tokenizer, _ = convert(_field(reader, "general.architecture", path), tokenizer_dict)
    return tokenizer


def _add_bos_eos(reader: GGUFFile, path: str, special: dict[str, int | None]) -> tuple[bool, bool]:
    """Whether the model expects BOS / EOS around every text: the file's flags if it has them, else
    llama.cpp's defaults (BOS for a sentencepiece vocabulary only, never EOS)."""
    sentencepiece = _field(reader, "tokenizer.ggml.model", path) == "llama"
    add_bos = bool(_field(reader, "tokenizer.ggml.add_bos_token", path, sentencepiece))
    add_eos = bool(_field(reader, "tokenizer.ggml.add_eos_token", path, False))
    # a flag naming a token the file does not have cannot be honoured
    return add_bos and special["bos"] is not None, add_eos and special["eos"] is not None


def _special_token_template(bos: tuple[str, int] | None,
                            eos: tuple[str, int] | None) -> processors.TemplateProcessing:
    """The post-processor HF's tokenizer uses: [BOS] text [EOS], each only if given.

    Set explicitly because the converted tokenizer's own template ignores the file's add_bos flag.
    """
    prefix = [bos[0]] if bos else []
    suffix = [eos[0]] if eos else []
    return processors.TemplateProcessing(
        single=prefix + ["$A:0"] + suffix,
        pair=prefix + ["$A:0"] + suffix + prefix + ["$B:1"] + suffix,
        # deduplicated: a few vocabularies use one token for both
        special_tokens=list(dict(t for t in (bos, eos) if t).items()),
    )
