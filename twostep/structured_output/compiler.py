"""Constraints in, llguidance grammars out: compile a StructuredOutputsParams once per distinct
constraint (cached by its canonical text) and hand each request its own matcher.

The llguidance tokenizer (a copy of the model's token table, with the byte strings of every token)
is built on the first constrained request, not at start-up: about 0.4 s for a 49k vocabulary.
Compiling checks the grammar against it, so a schema or pattern the backend cannot take fails here,
before the request exists, with llguidance's own message naming the construct.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import llguidance

from twostep.sampling_params import StructuredOutputsParams
from twostep.structured_output.grammar import DeferredGrammar, Grammar
from twostep.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# JSON with fixed separators, as json.dumps writes it (what models saw most in training).
_COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_FLEXIBLE_JSON = {"whitespace_flexible": True}
_ANY_JSON_OBJECT = {"type": "object"}


@dataclass(slots=True)
class CompileStats:
    """Counters since start (the compile cache's figures)."""

    num_compiled: int = 0
    num_cache_hits: int = 0
    compile_seconds: float = 0.0


class GrammarCompiler:
    """Compiles constraints for one model's vocabulary; thread-safe (the server's request
    handlers and the engine's step may both call it)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: set[int],
                 cache_size: int = 256) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.cache_size = cache_size
        self.stats = CompileStats()
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = self._build_ll_tokenizer()
            return self._ll_tokenizer

    def _build_ll_tokenizer(self) -> llguidance.LLTokenizer:
        start = time.monotonic()
        eos = self.eos_token_ids or None
        built = llguidance.LLTokenizer(self.tokenizer.backend.to_str(), n_vocab=self.vocab_size, eos_token=eos)
        plain = _plain_added_tokens(self.tokenizer, self.vocab_size)
        if plain:
            built = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_PlainAddedTokens(built, plain, self.tokenizer)),
                                           n_vocab=self.vocab_size, eos_token=eos)
        logger.info("structured outputs: token table for %d tokens built in %.2f s",
                    self.vocab_size, time.monotonic() - start)
        return built

    def grammar(self, params: StructuredOutputsParams) -> Grammar | DeferredGrammar:
        """A fresh matcher for one request; raises ValueError when the constraint does not compile."""
        key = params.key()
        with self._lock:
            template = self._cache.get(key)
            if template is not None:
                self._cache.move_to_end(key)
                self.stats.num_cache_hits += 1
        if template is None:       # compiled outside the lock: a long compile blocks no one else
            template = self._compile(params)
            with self._lock:
                self._cache[key] = template
                if len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
        grammar = Grammar(template.deep_copy(), self.vocab_size, frozenset(self.ll_tokenizer.eos_tokens))
        if params.starts_after is None:
            return grammar
        return DeferredGrammar(grammar, self.tokenizer.encode(params.starts_after, add_special_tokens=False))

    def _compile(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        start = time.monotonic()
        text = grammar_text(params)
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text, self.ll_tokenizer)
        if failed:
            raise ValueError(f"structured_outputs.{params.kind} cannot be compiled: {messages[0]}")
        matcher = llguidance.LLMatcher(self.ll_tokenizer, text, log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured_outputs.{params.kind} cannot be compiled: {matcher.get_error()}")
        for warning in messages:
            logger.warning("structured_outputs.%s: %s", params.kind, warning)
        elapsed = time.monotonic() - start
        with self._lock:
            self.stats.num_compiled += 1
            self.stats.compile_seconds += elapsed
        logger.debug("compiled a %s constraint in %.1f ms", params.kind, elapsed * 1e3)
        return matcher


def _plain_added_tokens(tokenizer: Tokenizer, vocab_size: int) -> set[int]:
    """Added tokens that are text, not control: Qwen's <think>, </think>, <tool_call> (special=False
    in tokenizer.json). llguidance reads every added token as a special one, which no grammar literal
    can match, so a grammar could not force "<think>" or "<tool_call>" where they are such tokens."""
    return {i for i, t in tokenizer.backend.get_added_tokens_decoder().items() if not t.special and i < vocab_size}


class _PlainAddedTokens:
    """llguidance's token table (TokenizerWrapper's source) with the plain added tokens as the text
    they are: every token's bytes as llguidance read them, special ones those it found minus the
    plain added tokens; strings tokenized as the model's tokenizer does (added tokens whole)."""

    bos_token_id = None

    def __init__(self, table: llguidance.LLTokenizer, plain: set[int], tokenizer: Tokenizer) -> None:
        self.eos_token_id = table.eos_token
        self.tokens = [table.decode_bytes([i]) for i in range(table.vocab_size)]
        self.special_token_ids = [i for i in range(table.vocab_size) if table.is_special_token(i) and i not in plain]
        self._tokenizer = tokenizer

    def __call__(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False)


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar for a constraint (its JSON form)."""
    kind = params.kind
    if kind in ("json", "json_object"):
        schema = _ANY_JSON_OBJECT if kind == "json_object" else params.json
        if params.disable_additional_properties and isinstance(schema, dict):
            schema = _closed_objects(schema)
        options = _COMPACT_JSON if params.disable_any_whitespace else _FLEXIBLE_JSON
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options)
        except ValueError as e:
            raise ValueError(f"structured_outputs.json is not a valid JSON schema: {e}") from None
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":
        return llguidance.grammar_from("choice", json.dumps(params.choice))
    try:
        return llguidance.grammar_from("grammar", params.grammar)   # Lark, or GBNF converted to Lark
    except ValueError as e:
        raise ValueError(f"structured_outputs.grammar cannot be read: {e}") from None


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_VALUES = ("items", "additionalProperties", "not", "if", "then", "else", "contains")


def _closed_objects(schema: dict) -> dict:
    """A copy of the schema where every object schema without additionalProperties gets false."""
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _closed(s) for name, s in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_closed(s) for s in out[key]]
    for key in _SCHEMA_VALUES:
        if key in out:
            out[key] = _closed(out[key])
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _closed(schema):
    return _closed_objects(schema) if isinstance(schema, dict) else schema
