"""Where a model's shape comes from: a preset name, a HF folder or config.json, or a GGUF file.

Analysis needs only the config and how many bytes a stored weight takes, so nothing here reads a
weight: a GGUF file's header and tensor table are enough.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from twostep.analysis.model_presets import MODEL_PRESETS, find_model_preset
from twostep.analysis.number_formats import NumberFormat, find_format

# GGUF architecture names whose metadata keys map one to one onto a HF config of these classes
# (a llama file with experts is Mixtral, as the engine's GGUF loader reads it).
_GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                       "qwen3": "Qwen3ForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM"}
_GGUF_ROUTER = re.compile(r"blk\.(\d+)\.ffn_gate_inp\.weight")
_GGUF_FLOAT_TYPES = {"F32": "fp32", "F16": "fp16", "BF16": "bf16"}


@dataclass(slots=True, frozen=True)
class ModelSource:
    name: str
    hf_config: dict
    stored_format: NumberFormat     # what --dtype auto means for this model


def load_model_source(model: str) -> ModelSource:
    path = Path(model)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"{model!r} is a folder without config.json")
        return _config_json_source(path / "config.json")
    if path.is_file():
        return _gguf_source(path) if path.suffix == ".gguf" else _config_json_source(path)
    preset = find_model_preset(model)
    if preset is not None:
        return source_from_hf_config(preset.hf_config(), preset.name)
    if path.suffix in (".gguf", ".json") or model.startswith((".", "/")):   # meant as a path
        raise ValueError(f"{model!r} does not exist")
    names = ", ".join(p.key for p in MODEL_PRESETS)
    raise ValueError(f"{model!r} is not a model folder, config.json, .gguf file or preset name "
                     f"(presets: {names})")


def _config_json_source(path: Path) -> ModelSource:
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    return source_from_hf_config(config, path.parent.name if path.name == "config.json" else path.stem)


def source_from_hf_config(config: dict, name: str) -> ModelSource:
    # transformers 5 writes "dtype", 4.x "torch_dtype" (a multimodal checkpoint's language model may
    # keep it in text_config); checkpoints without either are nearly all published in bf16 nowadays.
    text = config.get("text_config") or {}
    stored = find_format(config.get("dtype") or config.get("torch_dtype") or text.get("dtype")
                         or text.get("torch_dtype") or "bfloat16")
    return ModelSource(name, config, stored)


def _gguf_source(path: Path) -> ModelSource:
    from twostep.models.gguf_file import GGUFFile

    reader = GGUFFile(str(path))     # memory-maps the file; tensor data is never touched here
    meta = {name: value for name, value in reader.fields.items() if not name.startswith("tokenizer.")}
    arch = meta.get("general.architecture")
    if arch not in _GGUF_ARCHITECTURES:
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported for analysis; "
                         f"supported: {', '.join(_GGUF_ARCHITECTURES)}")
    tensors = {t.name: t for t in reader.tensors}
    try:
        config = _gguf_hf_config(meta, arch, tensors)
    except KeyError as e:
        raise ValueError(f"{path}: GGUF file lacks {e.args[0]!r}") from None
    return ModelSource(path.stem, config, _gguf_stored_format(reader))


def _gguf_hf_config(meta: dict, arch: str, tensors: dict) -> dict:
    """llama.cpp's metadata keys under their HF config.json names, for the fields analysis reads."""
    def key(name: str) -> str:
        return f"{arch}.{name}"

    heads = meta[key("attention.head_count")]
    hidden = meta[key("embedding_length")]
    experts = meta.get(key("expert_count"), 0)
    feed_forward = key("feed_forward_length")
    if experts and feed_forward not in meta:    # a MoE file without dense layers may leave it out
        feed_forward = key("expert_feed_forward_length")
    config = {
        "architectures": [_GGUF_ARCHITECTURES[arch]],
        "hidden_size": hidden,
        "intermediate_size": meta[feed_forward],
        "num_hidden_layers": meta[key("block_count")],
        "num_attention_heads": heads,
        "num_key_value_heads": meta.get(key("attention.head_count_kv"), heads),
        "head_dim": meta.get(key("attention.key_length"), hidden // heads),   # llama.cpp's default
        # ggml lists the fastest-moving dimension first: the embedding's last one is its row count.
        "vocab_size": int(tensors["token_embd.weight"].shape[-1]),
        "max_position_embeddings": meta[key("context_length")],
        "tie_word_embeddings": "output.weight" not in tensors,
    }
    if experts:
        config |= _gguf_experts(meta, key, config, tensors, arch)
    return config


def _gguf_experts(meta: dict, key, config: dict, tensors: dict, arch: str) -> dict:
    """A mixture of experts' keys under their HF names: the expert count, how many a token takes,
    each one's size; a layer routes to experts where it has a router (ffn_gate_inp), the others
    are dense (mlp_only_layers), as the engine's GGUF loader reads them."""
    routed = {int(m[1]) for name in tensors if (m := _GGUF_ROUTER.fullmatch(name))}
    moe = {"num_experts": meta[key("expert_count")], "num_experts_per_tok": meta[key("expert_used_count")],
           "moe_intermediate_size": meta.get(key("expert_feed_forward_length"), config["intermediate_size"]),
           "mlp_only_layers": sorted(set(range(config["num_hidden_layers"])) - routed)}
    if arch == "llama":
        moe["architectures"] = ["MixtralForCausalLM"]
    return moe


def _gguf_stored_format(reader) -> NumberFormat:
    """A file of one float type is that type. Otherwise the bytes per weight twostep reads when it
    runs the file, averaged over all its tensors and named after the type of most of the weights:
    the file's own (block scales included: Q4_0 4.5 bits, Q8_0 8.5, Q4_1 5.0), except for the
    K-quants, whose sub-block scales the packed layout multiplies out into one float16 per group
    (Q4_K 4.5 -> 5.0 bits, Q5_K 5.5 -> 6.0, Q6_K 6.5625 -> 7.0; quantization/packed.py)."""
    from twostep.quantization.gguf_blocks import held_bytes

    elements: dict[str, int] = {}
    for t in reader.tensors:
        elements[t.tensor_type.name] = elements.get(t.tensor_type.name, 0) + int(t.n_elements)
    if len(elements) == 1 and next(iter(elements)) in _GGUF_FLOAT_TYPES:
        return find_format(_GGUF_FLOAT_TYPES[next(iter(elements))])
    total_bytes = sum(held_bytes(t.tensor_type, [int(d) for d in t.shape], int(t.n_bytes))
                      for t in reader.tensors)
    main_type = max(elements, key=elements.get)
    return NumberFormat(f"gguf {main_type}", total_bytes / sum(elements.values()))
