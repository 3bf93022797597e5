"""From a checkpoint's architecture (HF config.json's `architectures`, a GGUF file's
`general.architecture`) to the family file that builds it (models/families/)."""
from __future__ import annotations

from typing import Any

from twostep.models.config import ModelConfig
from twostep.models.families import FAMILIES
from twostep.models.family import Family


def config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    """The model's config, read by its family from a HF config.json."""
    try:
        return family_for_hf(cfg).config(cfg, hf_architecture(cfg))
    except KeyError as e:
        raise ValueError(f"config.json lacks the field {e.args[0]!r}") from None


# A pooling checkpoint names its decoder by another class: the base model (Qwen3Model: no lm_head, weights
# without the model. prefix) or a classifier (Qwen3ForSequenceClassification: a score head for the
# lm_head). The decoder is the causal LM's of the same prefix (models/pooling.py reads the rest).
POOLING_SUFFIXES = ("ForSequenceClassification", "Model")


def causal_architecture(arch: str) -> str:
    """The causal LM class whose decoder an architecture has: itself, or for a pooling class the
    ForCausalLM of its prefix."""
    for suffix in POOLING_SUFFIXES:
        if arch.endswith(suffix) and not arch.endswith("ForCausalLM"):
            return arch[: -len(suffix)] + "ForCausalLM"
    return arch


def family_for_hf(cfg: dict[str, Any]) -> Family:
    archs = [causal_architecture(a) for a in cfg.get("architectures") or []]
    for family in FAMILIES:
        if any(a in family.hf_architectures for a in archs):
            return family
    supported = [a for f in FAMILIES for a in f.hf_architectures]
    raise ValueError(f"unsupported model architecture {cfg.get('architectures') or cfg.get('model_type')!r}: "
                     f"twostep supports {', '.join(supported)} (and their *Model and *ForSequenceClassification "
                     "forms, as pooling models)")


def family_named(architecture: str) -> Family:
    """The family of a ModelConfig's (HF) architecture."""
    return family_for_hf({"architectures": [architecture]})


def gguf_families() -> dict[str, Family]:
    return {arch: f for f in FAMILIES for arch in f.gguf_architectures}


def hf_architecture(cfg: dict[str, Any]) -> str:
    """The first of the config's architectures a family supports (a pooling class as its causal LM's)."""
    family = family_for_hf(cfg)
    return next(c for c in map(causal_architecture, cfg["architectures"]) if c in family.hf_architectures)


