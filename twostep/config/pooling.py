"""Pooling models (embeddings, classification, scores), vLLM's names: `--runner pooling`, `--convert`
(what the pooling runner makes of the checkpoint), `--task` (vLLM's older spelling of both) and
`--pooler-config` (PoolerConfig: the pooler's settings over what the checkpoint says). What the
engine then computes is a PoolingModel, resolved from the checkpoint by models/pooling.py.

    twostep serve Qwen/Qwen3-Embedding-0.6B                        # a base model: embeddings
    twostep serve reranker-folder --runner pooling --convert classify
    twostep serve some-causal-lm --runner pooling --pooler-config '{"pooling_type": "MEAN"}'
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields

from twostep.config.options import option

RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "embed", "classify")
# vLLM's older --task: each value is a runner and what it converts the checkpoint to
TASKS = {"generate": ("generate", "auto"), "embed": ("pooling", "embed"), "classify": ("pooling", "classify"),
         "score": ("pooling", "auto")}
POOLING_TYPES = ("LAST", "MEAN", "CLS")
_GROUP = "pooling"


def _pooling_type(value: str) -> str:
    return str(value).upper()


def _boolean(value: str) -> bool:
    """A flag's true / false (the JSON's booleans stay booleans)."""
    text = str(value).lower()
    if text not in ("true", "false", "1", "0"):
        raise ValueError(f"expected true or false, got {value!r}")
    return text in ("true", "1")


@dataclass(slots=True)
class PoolerConfig:
    """The pooler (--pooler-config's keys, vLLM's; each flag overrides its key, each key what the checkpoint says)."""

    pooling_type: str | None = option(
        None, "LAST: the last prompt token's hidden state (after the final norm); MEAN: the mean over every "
        "prompt token's; CLS: the first token's (default: a sentence-transformers folder's 1_Pooling, else LAST)",
        choices=POOLING_TYPES, type=_pooling_type, overlay=True, group=_GROUP)
    normalize: bool | None = option(
        None, "embeddings scaled to unit length (default: true, or in a sentence-transformers folder whether "
        "it has a Normalize module); --no-normalize: false", type=_boolean, metavar="BOOL", const=True,
        negative=False, overlay=True, group=_GROUP)
    activation: bool | None = option(
        None, "classification: sigmoid of the logit (one label) or softmax over the labels, as vLLM's "
        "default; false (--no-activation): the raw logits", type=_boolean, metavar="BOOL", const=True,
        negative=False, overlay=True, group=_GROUP)

    def __post_init__(self) -> None:
        if self.pooling_type is not None:
            if not isinstance(self.pooling_type, str) or self.pooling_type.upper() not in POOLING_TYPES:
                raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}; got {self.pooling_type!r}")
            self.pooling_type = self.pooling_type.upper()
        for name in ("normalize", "activation"):
            if getattr(self, name) not in (None, True, False):
                raise ValueError(f"pooler config {name} must be true or false, got {getattr(self, name)!r}")

    @classmethod
    def parse(cls, value: "PoolerConfig | dict | str | None") -> "PoolerConfig | None":
        """From a PoolerConfig, a dict, or its JSON text (as --pooler-config takes it)."""
        if value is None or isinstance(value, PoolerConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"pooler config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError("pooler config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown pooler config keys {unknown}; known: {sorted(known)}")
        return cls(**value)


def runner_and_convert(runner: str, convert: str, task: str | None) -> tuple[str, str]:
    """--runner and --convert, with vLLM's older --task laid over them where they are left at auto."""
    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {', '.join(RUNNERS)}; got {runner!r}")
    if convert not in CONVERTS:
        raise ValueError(f"convert must be one of {', '.join(CONVERTS)}; got {convert!r}")
    if task is None:
        return runner, convert
    if task not in TASKS:
        raise ValueError(f"task must be one of {', '.join(TASKS)}; got {task!r}")
    task_runner, task_convert = TASKS[task]
    if runner not in ("auto", task_runner) or convert not in ("auto", task_convert) and task_convert != "auto":
        raise ValueError(f"task {task!r} means runner {task_runner!r}"
                         f"{'' if task_convert == 'auto' else f' and convert {task_convert!r}'}: "
                         f"not runner {runner!r} and convert {convert!r}")
    return task_runner, convert if task_convert == "auto" else task_convert


@dataclass(frozen=True, slots=True)
class PoolingModel:
    """What a pooling engine computes for a prompt, resolved from the checkpoint and --pooler-config
    (models/pooling.py): an embedding (the pooled final hidden state) or a classification (the
    checkpoint's score head on the pooled last token)."""

    task: str                                # "embed" or "classify"
    pooling_type: str                        # LAST, MEAN or CLS
    normalize: bool                          # embed: unit length, unless a request says otherwise
    activation: bool                         # classify: sigmoid / softmax, unless a request says otherwise
    hidden_size: int                         # an embedding's length
    num_labels: int = 0                      # classify: the score head's outputs
    # Matryoshka embeddings (config.json's is_matryoshka or matryoshka_dimensions, as vLLM reads them):
    # a request's `dimensions` keeps an embedding's first d values; any d, or only the listed ones
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None
    # a text is read as one user message through the chat template (no generation prompt), as
    # sentence-transformers >= 6 encodes it where the folder's Transformer config lists the "message"
    # modality; else it is tokenized as it is (vLLM's rule)
    texts_as_messages: bool = False

    @property
    def needs_every_position(self) -> bool:
        """MEAN and CLS read prompt positions a prefix-cache hit would skip: those requests compute
        their whole prompt (their hidden states are never cached, only K/V)."""
        return self.pooling_type != "LAST"

    def check_dimensions(self, dimensions: int | None) -> None:
        """A request's `dimensions`: only where the model was trained for it (vLLM's rule)."""
        if dimensions is None:
            return
        if self.task != "embed":
            raise ValueError("dimensions applies to embeddings; this model classifies")
        if not self.is_matryoshka:
            raise ValueError("this model does not support matryoshka representation (its config.json has neither "
                             "is_matryoshka nor matryoshka_dimensions): changing output dimensions would give "
                             "poor embeddings")
        if not isinstance(dimensions, int) or isinstance(dimensions, bool) or dimensions < 1:
            raise ValueError(f"dimensions must be a positive integer, got {dimensions!r}")
        if dimensions > self.hidden_size:
            raise ValueError(f"dimensions {dimensions} is more than the model's embedding size {self.hidden_size}")
        if self.matryoshka_dimensions is not None and dimensions not in self.matryoshka_dimensions:
            raise ValueError(f"dimensions {dimensions} is not one this model supports: "
                             f"{list(self.matryoshka_dimensions)}")

    def encode_text(self, tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
        """A text prompt's token ids as this model reads it (texts_as_messages: as a user message)."""
        if self.texts_as_messages:
            return tokenizer.encode_chat([{"role": "user", "content": text}], add_generation_prompt=False)
        return tokenizer.encode(text, add_special_tokens)
