"""Per-request sampling and stopping parameters (vLLM-shaped), validated on creation."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

GREEDY_TEMPERATURE = 1e-5   # below this, sampling is argmax


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens and when to stop. temperature 0 means greedy.

    Every bad value raises ValueError naming the field, so a caller (CLI, HTTP)
    can report it without the engine ever seeing the request.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1            # -1 (or 0) disables
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None          # top-N logprobs per generated token (0: the sampled token only)
    prompt_logprobs: int | None = None   # top-N logprobs per prompt token (0: the prompt token only)
    skip_special_tokens: bool = True
    # Filled by the engine: EOS ids from generation_config/tokenizer (not user-facing).
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == 0:
            self.top_k = -1
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"{name} {why}, got {getattr(self, name)!r}")

        for name in ("n", "top_k", "min_tokens"):
            if not _is_int(getattr(self, name)):
                raise bad(name, "must be an integer")
        for name in ("max_tokens", "logprobs", "prompt_logprobs", "seed"):
            value = getattr(self, name)
            if value is not None and not _is_int(value):
                raise bad(name, "must be an integer or null")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise bad(name, "must be a finite number")
        if self.n < 1:
            raise bad("n", "must be >= 1")
        if self.temperature < 0:
            raise bad("temperature", "must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if self.top_k < -1:
            raise bad("top_k", "must be -1 (disabled) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "must be > 0")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "must be in [-2, 2]")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad("max_tokens", "must be >= 1")
        if self.min_tokens < 0:
            raise bad("min_tokens", "must be >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and self.logprobs < 0:
            raise bad("logprobs", "must be >= 0")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise bad("prompt_logprobs", "must be >= 0")
        # seed + index seeds the n children; torch takes seeds in [0, 2**64).
        if self.seed is not None and not 0 <= self.seed <= 2**64 - self.n:
            raise bad("seed", f"must be in [0, 2**64 - n]")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise bad("stop", "must be non-empty strings")
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative integers")
        if self.n > 1 and self.temperature == 0:
            raise bad("n", "must be 1 with greedy sampling (temperature 0)")

    @property
    def greedy(self) -> bool:
        """The sampler takes the argmax (temperature 0; tinier ones would only overflow)."""
        return self.temperature < GREEDY_TEMPERATURE


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
