"""Per-request sampling and stopping parameters (vLLM-shaped), validated on creation."""
from __future__ import annotations

import copy
import enum
import json
import math
from dataclasses import dataclass, field
from typing import Any

GREEDY_TEMPERATURE = 1e-5   # below this, sampling is argmax
LOGIT_BIAS_LIMIT = 100.0    # OpenAI's range for logit_bias values: [-100, 100]
_CONSTRAINT_KINDS = ("json", "json_object", "regex", "choice", "grammar")


class RequestOutputKind(enum.Enum):
    """What each RequestOutput of a request holds (vLLM's names)."""

    CUMULATIVE = 0      # everything so far (text, token_ids, logprobs), with the deltas beside
    DELTA = 1           # only what is new since the previous output
    FINAL_ONLY = 2      # no output until the request finishes


@dataclass(slots=True)
class StructuredOutputsParams:
    """One constraint on the generated text (vLLM's StructuredOutputsParams): exactly one of

    json: a JSON schema (a dict, or its JSON text) the output must validate against;
    json_object: any JSON object;
    regex: a regular expression the whole output must match (Rust regex syntax: no look-around,
        no backreferences);
    choice: the output is exactly one of these strings;
    grammar: a context-free grammar, in Lark syntax or GBNF (llama.cpp's), as llguidance takes it.

    disable_any_whitespace: JSON comes out with fixed separators (", " and ": ", no newlines),
        the default here, because free whitespace lets a small model loop on blank space; set it
        False to allow any whitespace between JSON tokens.
    disable_additional_properties: objects in the schema that do not say otherwise get
        "additionalProperties": false (JSON Schema's own default allows extra keys).
    starts_after: the constraint applies from the first time the output's tokens spell this text
        (as the tokenizer encodes it), the output before it is free: a reasoning model's end of
        thinking, so that it thinks first and then answers in the constrained form (vLLM's
        behaviour with a reasoning parser).
    """

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = True
    disable_additional_properties: bool = False
    starts_after: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except ValueError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise ValueError(f"structured_outputs.json must be a JSON schema object, got {type(self.json).__name__}")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise ValueError("structured_outputs.regex must be a non-empty string")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise ValueError("structured_outputs.grammar must be a non-empty string")
        if self.starts_after is not None and (not isinstance(self.starts_after, str) or not self.starts_after):
            raise ValueError("structured_outputs.starts_after must be a non-empty string")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or any(not isinstance(c, str) or not c for c in self.choice)):
                raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")
            self.choice = list(self.choice)
        given = self.kinds
        if len(given) != 1:
            raise ValueError("structured_outputs needs exactly one of json, json_object, regex, choice, "
                             f"grammar; got {', '.join(given) if given else 'none'}")

    @property
    def kinds(self) -> list[str]:
        return [k for k in _CONSTRAINT_KINDS
                if (getattr(self, k) is not None and getattr(self, k) is not False)]

    @property
    def kind(self) -> str:
        return self.kinds[0]

    def key(self) -> str:
        """A canonical text of the constraint: equal keys compile to the same grammar."""
        return json.dumps([self.kind, getattr(self, self.kind), self.disable_any_whitespace,
                           self.disable_additional_properties], sort_keys=True)

    @classmethod
    def from_dict(cls, value: Any) -> "StructuredOutputsParams":
        """From a request's JSON object (the HTTP API's structured_outputs field)."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError("structured_outputs must be an object")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"structured_outputs has unknown fields {unknown}; known: {sorted(known)}")
        return cls(**value)


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
    logprobs: int | None = None          # top-N logprobs per generated token (0: the sampled token only;
                                         # -1: as many as the engine allows, max_logprobs)
    prompt_logprobs: int | None = None   # top-N logprobs per prompt token (0: the prompt token only)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True   # accepted (vLLM); fast tokenizers decide spacing
    detokenize: bool = True                      # False: token ids only, no text (no stop strings)
    truncate_prompt_tokens: int | None = None    # keep only the prompt's last k tokens
    extra_args: dict | None = None               # carried along for callers' own use (vLLM's)
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Constraints on the next token, applied before everything else (sample/constraints.py):
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None   # token id -> added to its logit, in [-100, 100]
    allowed_token_ids: list[int] | None = None   # only these may be generated
    bad_words: list[str] | None = None           # words that must never be generated
    # Filled by the engine: EOS ids from generation_config/tokenizer (not user-facing).
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)
    # Filled by the engine: bad_words as token sequences (each word with and without a leading space).
    bad_words_token_ids: list[list[int]] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == 0:
            self.top_k = -1
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        self._validate()
        self._validate_constraints()

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
        if self.logprobs is not None and self.logprobs < -1:
            raise bad("logprobs", "must be >= 0, or -1 for the most the engine allows")
        if self.truncate_prompt_tokens is not None and (not _is_int(self.truncate_prompt_tokens)
                                                        or self.truncate_prompt_tokens < 1):
            raise bad("truncate_prompt_tokens", "must be a positive integer or null")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise bad("output_kind", "must be a RequestOutputKind")
        if not self.detokenize and self.stop:
            raise bad("stop", "needs detokenize=True (stop strings are matched in the text)")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise bad("prompt_logprobs", "must be >= 0")
        # seed + index seeds the n children; torch takes seeds in [0, 2**64).
        if self.seed is not None and not 0 <= self.seed <= 2**64 - self.n:
            raise bad("seed", f"must be in [0, 2**64 - n]")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise bad("stop", "must be non-empty strings")
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative integers")

    def _validate_constraints(self) -> None:
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be StructuredOutputsParams, got {type(so).__name__}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError("logit_bias must map token ids to numbers")
            for token, bias in self.logit_bias.items():
                if not _is_int(token) or token < 0:
                    raise ValueError(f"logit_bias keys must be non-negative token ids, got {token!r}")
                if (isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias)
                        or abs(bias) > LOGIT_BIAS_LIMIT):
                    raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {bias!r} "
                                     f"for token {token}")
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not isinstance(ids, (list, tuple)) or not ids or any(not _is_int(t) or t < 0 for t in ids):
                raise ValueError(f"allowed_token_ids must be a non-empty list of non-negative token ids, "
                                 f"got {ids!r}")
            self.allowed_token_ids = list(ids)
        if self.bad_words is not None:
            if not isinstance(self.bad_words, (list, tuple)) or any(
                    not isinstance(w, str) or not w.strip() for w in self.bad_words):
                raise ValueError(f"bad_words must be non-empty strings, got {self.bad_words!r}")
            self.bad_words = list(self.bad_words)

    def clone(self) -> "SamplingParams":
        """A deep copy (vLLM's clone): nothing in it is shared with this one."""
        return copy.deepcopy(self)

    @property
    def has_token_constraints(self) -> bool:
        """Whether anything but the grammar restricts or shifts the next token's logits."""
        return bool(self.logit_bias or self.allowed_token_ids or self.bad_words_token_ids)

    @property
    def greedy(self) -> bool:
        """The sampler takes the argmax (temperature 0; tinier ones would only overflow)."""
        return self.temperature < GREEDY_TEMPERATURE


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
