"""`--speculative-config`: vLLM's JSON keys for the three methods twostep implements.

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    {"method": "draft_model", "model": "path/or/hub-id", "num_speculative_tokens": 4, "dtype": "auto"}
    {"method": "mtp", "num_speculative_tokens": 2}    # the target checkpoint's own MTP layer (Qwen3.5, Qwen3-Next)
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, fields

from twostep.config.options import Option, option

METHODS = ("ngram", "draft_model", "mtp")


_GROUP = "speculative decoding"


@dataclass(slots=True)
class SpeculativeConfig:
    """Speculative decoding (--speculative-config's keys; each flag overrides its key)."""

    method: str = field(metadata={"option": Option("short for the JSON's method: ngram (prompt lookup), draft_model "
                                                   "(a smaller model), mtp (the target checkpoint's own "
                                                   "multi-token-prediction layer: Qwen3.5, Qwen3.5-MoE, Qwen3-Next "
                                                   "checkpoints that ship mtp.* weights)", flag="--speculative-method",
                                                   choices=METHODS, overlay=True, group=_GROUP)})
    num_speculative_tokens: int = option(4, "drafts per step (k)", overlay=True, group=_GROUP)
    prompt_lookup_max: int = option(4, "ngram: the longest suffix n-gram looked up", overlay=True, group=_GROUP)
    prompt_lookup_min: int = option(2, "ngram: the shortest", overlay=True, group=_GROUP)
    model: str | None = option(None, "draft_model: the draft model (folder, .gguf or hub id)",
                               flag="--speculative-model", overlay=True, group=_GROUP)
    dtype: str = option("auto", "draft_model: its dtype (auto: the target's)", flag="--speculative-dtype",
                        choices=("auto", "float32", "bfloat16", "float16"), overlay=True, group=_GROUP)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(METHODS)}; got {self.method!r}")
        if not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be a positive integer, "
                             f"got {self.num_speculative_tokens!r}")
        if self.method == "ngram":
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
                raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {lo} and {hi}")
        if self.method == "draft_model" and not self.model:
            raise ValueError('method "draft_model" needs "model": the draft model to load')
        if self.method == "mtp" and self.model:
            raise ValueError('method "mtp" drafts with the target checkpoint\'s own MTP layer: it takes no "model"')
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"draft dtype must be auto, float32, bfloat16 or float16; got {self.dtype!r}")

    @classmethod
    def parse(cls, value: "SpeculativeConfig | dict | str | None") -> "SpeculativeConfig | None":
        """From a SpeculativeConfig, a dict, or its JSON text (as --speculative-config takes it)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError("speculative config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown speculative config keys {unknown}; known: {sorted(known)}")
        if "method" not in value:   # as vLLM: a model alone means a draft model
            if "model" not in value:
                raise ValueError('speculative config needs "method" ("ngram", "draft_model" or "mtp")')
            value = {**value, "method": "draft_model"}
        return cls(**value)
