"""Prompt in, requests out: tokenize (encode_chat: a conversation through the chat template),
check what the model and the engine allow, and fan a request with n > 1 out into child requests. No
side effects: a prompt that fails a check leaves the engine as it was."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from twostep.config import EngineConfig, PoolingModel
from twostep.core.scheduling.request import Request
from twostep.engine.parallel_sampling import ParentRequest, child_params
from twostep.outputs import RequestMetrics, SpecDecodeStats
from twostep.pooling_params import PoolingParams
from twostep.sample.sampler import make_generator
from twostep.sampling_params import SamplingParams
from twostep.structured_output.compiler import GrammarCompiler
from twostep.tokenizer.tokenizer import Tokenizer

PromptInput = str | list[int]


@dataclass(slots=True)
class ProcessedPrompt:
    prompt: str | None                       # the text, when the prompt was text
    requests: list[Request]                  # one, or n children
    parent: ParentRequest | None = None      # n > 1: merges the children's outputs

    @property
    def request_ids(self) -> list[str]:
        ids = [r.request_id for r in self.requests]
        return ids if self.parent is None else [self.parent.request_id, *ids]


@dataclass(slots=True)
class ModelLimits:
    vocab_size: int
    max_model_len: int
    kv_capacity_tokens: int                  # the whole KV cache, in tokens
    eos_token_ids: frozenset[int]


class InputProcessor:
    def __init__(self, tokenizer: Tokenizer, config: EngineConfig, limits: ModelLimits,
                 device: torch.device, speculative: bool, grammars: GrammarCompiler,
                 pooling: PoolingModel | None = None, can_generate: bool = True) -> None:
        """pooling: what a pooling engine computes (None: it takes no PoolingParams); can_generate:
        the model has an lm_head (a pooling checkpoint may have none)."""
        self.tokenizer, self.config, self.limits = tokenizer, config, limits
        self.device, self.speculative = device, speculative
        self.grammars = grammars
        self.pooling, self.can_generate = pooling, can_generate

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> list[int]:
        """A conversation through the model's chat template, as token ids."""
        return self.tokenizer.encode_chat(messages, add_generation_prompt, **kwargs)

    def process(self, prompt: PromptInput, params: SamplingParams | PoolingParams, request_id: str,
                arrival_time: float) -> ProcessedPrompt:
        """Raises ValueError naming what is wrong with the prompt or params."""
        if isinstance(params, PoolingParams):
            return self._process_pooling(prompt, params, request_id, arrival_time)
        if not self.can_generate:
            raise ValueError("this model has no lm_head (a pooling checkpoint): it makes embeddings or scores "
                             "(PoolingParams: LLM.embed, LLM.score), it does not generate")
        params = self._resolve(params)
        self._check_params(params)
        text, ids = self._tokenize(prompt)
        if params.truncate_prompt_tokens is not None:
            ids = ids[-params.truncate_prompt_tokens:]
        self._check_prompt(ids)
        if params.structured_outputs is not None:
            self.grammars.grammar(params.structured_outputs)   # compiles (cached), or raises
        if params.bad_words:
            params = dataclasses.replace(params, bad_words_token_ids=self._bad_words_ids(params.bad_words))
        if params.n == 1:
            return ProcessedPrompt(text, [self._make_request(request_id, ids, params, arrival_time)])
        parent = ParentRequest(request_id, params.n)
        children = [self._make_request(cid, ids, child_params(params, i), arrival_time)
                    for i, cid in enumerate(parent.child_ids)]
        return ProcessedPrompt(text, children, parent)

    def _process_pooling(self, prompt: PromptInput, params: PoolingParams, request_id: str,
                         arrival_time: float) -> ProcessedPrompt:
        """A pooling request: prefill only, so its prompt may fill max_model_len."""
        pooling = self.pooling
        if pooling is None:
            raise ValueError("this engine generates (--runner generate): it has no pooler; start it with "
                             "--runner pooling (an embedding or classification model) for embeddings and scores")
        if params.task not in (None, pooling.task):
            does = {"embed": "makes embeddings", "classify": "classifies"}
            raise ValueError(f"this model {does[pooling.task]} (--convert {pooling.task}); it cannot serve "
                             f"{params.task!r} requests")
        pooling.check_dimensions(params.dimensions)
        if isinstance(prompt, str) and prompt:      # as the model reads a text (maybe as a chat message)
            text, ids = prompt, pooling.encode_text(self.tokenizer, prompt)
        else:
            text, ids = self._tokenize(prompt)
        if params.truncate_prompt_tokens is not None:
            ids = ids[-params.truncate_prompt_tokens:]
        self._check_prompt(ids, generates=False)
        request = Request(request_id=request_id, prompt_token_ids=ids, params=params,
                          metrics=RequestMetrics(arrival_time=arrival_time, num_prompt_tokens=len(ids)),
                          max_total_tokens=len(ids), pools_every_position=pooling.needs_every_position)
        return ProcessedPrompt(text, [request])

    def _make_request(self, request_id: str, ids: list[int], params: SamplingParams,
                      arrival_time: float) -> Request:
        params = dataclasses.replace(params)
        params.all_stop_token_ids = set() if params.ignore_eos else set(self.limits.eos_token_ids)
        max_len = self.limits.max_model_len
        limit = max_len if params.max_tokens is None else len(ids) + params.max_tokens
        return Request(
            request_id=request_id, prompt_token_ids=ids, params=params,
            metrics=RequestMetrics(arrival_time=arrival_time, num_prompt_tokens=len(ids),
                                   spec_decode=SpecDecodeStats() if self.speculative else None),
            generator=make_generator(params.seed, self.device),
            max_total_tokens=min(limit, max_len),
            grammar=(None if params.structured_outputs is None
                     else self.grammars.grammar(params.structured_outputs)),
        )

    def _resolve(self, params: SamplingParams) -> SamplingParams:
        """What the request's own values stand for here: logprobs -1 is the engine's max_logprobs."""
        if params.logprobs == -1:
            return dataclasses.replace(params, logprobs=self.config.max_logprobs)
        return params

    def _bad_words_ids(self, words: list[str]) -> list[list[int]]:
        """Each bad word as the token sequences it can be generated as: at the start of the text
        and after a space (vLLM's rule), without duplicates."""
        out: list[list[int]] = []
        for word in words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                if ids and ids not in out:
                    out.append(ids)
        return out

    def _tokenize(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty: give at least one character or token")
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise ValueError("prompt must be a string or a list of token ids")

    def _check_params(self, params: SamplingParams) -> None:
        """What SamplingParams cannot know alone: limits that depend on the model and engine."""
        vocab, c = self.limits.vocab_size, self.config
        for name, ids in (("stop_token_ids", params.stop_token_ids),
                          ("allowed_token_ids", params.allowed_token_ids or []),
                          ("logit_bias", list(params.logit_bias or {}))):
            bad = [t for t in ids if t >= vocab]
            if bad:
                raise ValueError(f"{name} {bad[:5]} are outside the vocabulary [0, {vocab})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > c.max_logprobs:
                raise ValueError(f"{name} must be <= {c.max_logprobs} (--max-logprobs), got {value}")
        if params.n > c.max_n:
            raise ValueError(f"n must be <= {c.max_n}, got {params.n}")

    def _check_prompt(self, ids: list[int], generates: bool = True) -> None:
        """generates: room for at least one generated token too (a pooling request needs none)."""
        vocab, max_len = self.limits.vocab_size, self.limits.max_model_len
        if not ids:
            raise ValueError("prompt is empty: give at least one character or token")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
        if generates and len(ids) >= max_len:
            raise ValueError(f"prompt has {len(ids)} tokens; max_model_len is {max_len}, "
                             "which must leave room for at least one generated token")
        if len(ids) > max_len:
            raise ValueError(f"prompt has {len(ids)} tokens; max_model_len is {max_len}")
        if len(ids) + generates > self.limits.kv_capacity_tokens:
            raise ValueError(f"prompt has {len(ids)} tokens but the whole KV cache holds "
                             f"{self.limits.kv_capacity_tokens}; raise --kv-cache-memory")
