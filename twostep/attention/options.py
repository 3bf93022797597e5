"""What one attention layer asks of the backend besides q, k and v: its query scale, and the
per-layer variants today's families use. Every backend (the reference one, the paged decode
kernel, the prefill path) honours all of them, so a layer's options never decide which backend runs."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False, slots=True)
class AttentionOptions:
    scale: float                        # head_dim ** -0.5, or the family's (Gemma's query_pre_attn_scalar, Granite's)
    # a query at position p sees keys at positions p - window < k <= p (HF's and llama.cpp's
    # sliding window); None: every earlier position
    window: int | None = None
    # Gemma 2: scores become softcap * tanh(scores / softcap) before the mask and softmax
    softcap: float | None = None
    # gpt-oss: a learned logit per query head [H] (float32) that joins each softmax's denominator
    # and adds no value: a query may put weight on "nothing"
    sinks: torch.Tensor | None = None

    def __post_init__(self) -> None:
        # float32 and contiguous once, as every backend reads them, rather than per call
        if self.sinks is not None:
            object.__setattr__(self, "sinks", self.sinks.detach().float().contiguous())
