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


def family_for_hf(cfg: dict[str, Any]) -> Family:
    archs = cfg.get("architectures") or []
    for family in FAMILIES:
        if any(a in family.hf_architectures for a in archs):
            return family
    supported = [a for f in FAMILIES for a in f.hf_architectures]
    raise ValueError(f"unsupported model architecture {archs or cfg.get('model_type')!r}: "
                     f"twostep supports {', '.join(supported)}")


def family_named(architecture: str) -> Family:
    """The family of a ModelConfig's (HF) architecture."""
    return family_for_hf({"architectures": [architecture]})


def gguf_families() -> dict[str, Family]:
    return {arch: f for f in FAMILIES for arch in f.gguf_architectures}


def hf_architecture(cfg: dict[str, Any]) -> str:
    """The first of the config's architectures a family supports."""
    family = family_for_hf(cfg)
    return next(a for a in cfg["architectures"] if a in family.hf_architectures)


