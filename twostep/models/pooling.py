"""A checkpoint as a pooling model (vLLM's pooling runner): what kind of checkpoint it is (a causal
LM, a base model without an lm_head such as Qwen3-Embedding's Qwen3Model, a *ForSequenceClassification
with a score head), how it pools (a sentence-transformers folder's Pooling and Normalize modules), its
Matryoshka dimensions, and a base model's tensor names as the decoder loads them. The result is a
PoolingModel (config/pooling.py), or None for an engine that generates."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from twostep.config.pooling import PoolerConfig, PoolingModel
from twostep.models.registry import config_from_hf

CAUSAL, BASE, CLASSIFIER = "causal", "base", "classifier"

# sentence-transformers' Pooling module: its config's modes, and the pooling each one is
_ST_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN", "pooling_mode_cls_token": "CLS"}
_ST_UNSUPPORTED_MODES = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                         "pooling_mode_weightedmean_tokens")
_ST_MODE_NAMES = {"lasttoken": "LAST", "mean": "MEAN", "cls": "CLS"}


def checkpoint_kind(hf_config: dict[str, Any]) -> str:
    """CLASSIFIER (a *ForSequenceClassification: the decoder and a score head), BASE (a *Model: the
    decoder alone) or CAUSAL (a causal LM with its lm_head)."""
    archs = hf_config.get("architectures") or []
    if any(a.endswith("ForSequenceClassification") for a in archs):
        return CLASSIFIER
    if archs and all(a.endswith("Model") for a in archs):
        return BASE
    return CAUSAL


def base_model_names(tensors: dict[str, Any]) -> dict[str, Any]:
    """A base model's tensors (embed_tokens.weight, layers.N...., norm.weight) under the names a causal
    LM's decoder has (model.embed_tokens.weight, ...); names that already have the prefix stay."""
    return {name if name.startswith("model.") else f"model.{name}": t for name, t in tensors.items()}


def resolve_pooling(path: str, runner: str, convert: str, overrides: PoolerConfig | None) -> PoolingModel | None:
    """What the engine computes for this checkpoint (runner and convert already resolved from --task):
    a PoolingModel for the pooling runner, None for the generate runner. Raises ValueError where the
    checkpoint cannot do what is asked."""
    folder = Path(path)
    if not (folder / "config.json").is_file():
        if runner == "pooling":
            raise ValueError(f"{path}: the pooling runner loads HF folders (config.json and safetensors); "
                             "a GGUF file runs with --runner generate")
        return None
    hf_config = json.loads((folder / "config.json").read_text())
    kind = checkpoint_kind(hf_config)
    st = _sentence_transformers_pooling(folder)
    if runner == "auto":
        runner = "pooling" if kind != CAUSAL or st is not None else "generate"
    if runner == "generate":
        if overrides is not None or convert != "auto":
            raise ValueError(f"{path} is a causal LM, run by the generate runner: --convert and the pooler "
                             "config apply to --runner pooling (add it to make embeddings from it)")
        if kind != CAUSAL:
            raise ValueError(f"{path} is a {hf_config['architectures'][0]} checkpoint: a pooling model without an "
                             "lm_head; run it with --runner pooling (embeddings, scores), not --runner generate")
        return None
    task = convert if convert != "auto" else "classify" if kind == CLASSIFIER else "embed"
    if task == "classify" and kind != CLASSIFIER:
        raise ValueError(f"{path} has no classification head (a *ForSequenceClassification checkpoint's score "
                         "weights): it can embed (--convert embed), not classify")
    overrides = overrides or PoolerConfig()
    st_type, st_normalize, st_messages = st if st is not None and task == "embed" else (None, None, False)
    matryoshka = hf_config.get("matryoshka_dimensions")
    return PoolingModel(
        task=task,
        pooling_type=overrides.pooling_type or st_type or "LAST",
        normalize=_first_set(overrides.normalize, st_normalize, True),
        activation=_first_set(overrides.activation, True),
        hidden_size=config_from_hf(hf_config).hidden_size,
        num_labels=_num_labels(hf_config) if task == "classify" else 0,
        is_matryoshka=bool(hf_config.get("is_matryoshka")) or matryoshka is not None,
        matryoshka_dimensions=None if matryoshka is None else tuple(int(d) for d in matryoshka),
        texts_as_messages=st_messages)


def _first_set(*values):
    return next(v for v in values if v is not None)


def _num_labels(hf_config: dict[str, Any]) -> int:
    """transformers saves id2label (num_labels is its length); 2 where neither is given, its default."""
    if hf_config.get("id2label"):
        return len(hf_config["id2label"])
    return int(hf_config.get("num_labels", 2))


def _sentence_transformers_pooling(folder: Path) -> tuple[str, bool, bool] | None:
    """A sentence-transformers folder (modules.json): its Pooling module's mode, whether a Normalize
    module follows, and whether its Transformer reads texts as chat messages; None for a plain HF
    folder. Modules twostep does not run are refused by name, so no embedding comes out different
    from SentenceTransformer.encode's."""
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return None
    modules = json.loads(modules_file.read_text())
    pooling_type, normalize, messages = "LAST", False, False
    for module in modules:
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        where = module.get("path", "")
        if kind == "Transformer":
            if where not in ("", "."):
                raise ValueError(f"{folder}: the sentence-transformers Transformer module is in {where!r}; twostep "
                                 "loads the model from the folder itself (as sentence-transformers saves it now)")
            messages = _st_reads_messages(folder)
        elif kind == "Pooling":
            pooling_type = _st_pooling_type(folder / where)
        elif kind == "Normalize":
            normalize = True
        else:
            raise ValueError(f"{folder}: the sentence-transformers module {kind!r} is not supported (twostep runs "
                             "Transformer, Pooling and Normalize)")
    return pooling_type, normalize, messages


def _st_reads_messages(folder: Path) -> bool:
    """sentence-transformers >= 6 saves the Transformer's modalities; where they include "message" (its
    tokenizer has a chat template), encode() renders each text as a user message through it."""
    config_file = folder / "sentence_bert_config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    return "message" in (config.get("modality_config") or {})


def _st_pooling_type(module_folder: Path) -> str:
    config_file = module_folder / "config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    if config.get("include_prompt") is False:
        raise ValueError(f"{module_folder}: pooling without the prompt (include_prompt false) is not supported")
    if isinstance(config.get("pooling_mode"), str):
        mode = config["pooling_mode"]
        if mode not in _ST_MODE_NAMES:
            raise ValueError(f"{module_folder}: pooling mode {mode!r} is not supported "
                             f"({', '.join(_ST_MODE_NAMES)} are)")
        return _ST_MODE_NAMES[mode]
    unsupported = [m for m in _ST_UNSUPPORTED_MODES if config.get(m)]
    chosen = [pooling for key, pooling in _ST_MODES.items() if config.get(key)]
    if unsupported or len(chosen) != 1:
        raise ValueError(f"{module_folder}: twostep pools by exactly one of last token, mean and CLS token; this "
                         f"Pooling module has {[m for m in (*_ST_MODES, *_ST_UNSUPPORTED_MODES) if config.get(m)]}")
    return chosen[0]
