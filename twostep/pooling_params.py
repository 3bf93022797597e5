"""Per-request pooling parameters (vLLM's PoolingParams): a request with these instead of
SamplingParams is prefill only and ends with one pooled vector (an embedding or a classification),
never a generated token. What the engine pools and its defaults are the model's (config/pooling.py's
PoolingModel); a request may only cut (dimensions) or skip the last step (normalize, activation)."""
from __future__ import annotations

from dataclasses import dataclass

POOLING_TASKS = ("embed", "classify")


@dataclass(slots=True)
class PoolingParams:
    task: str | None = None              # "embed" or "classify"; None: what the model does
    dimensions: int | None = None        # embed, Matryoshka models only: keep the first d values
    normalize: bool | None = None        # embed: unit length (None: the model's default)
    activation: bool | None = None       # classify: sigmoid / softmax (None: the model's default)
    truncate_prompt_tokens: int | None = None   # keep only the prompt's last k tokens

    def __post_init__(self) -> None:
        if self.task is not None and self.task not in POOLING_TASKS:
            raise ValueError(f"pooling task must be one of {', '.join(POOLING_TASKS)}; got {self.task!r}")
        for name in ("normalize", "activation"):
            if getattr(self, name) not in (None, True, False):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        for name in ("dimensions", "truncate_prompt_tokens"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
