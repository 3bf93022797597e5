"""A request's state under the counter model: it has all_token_ids (prompt + outputs so far)
and num_computed_tokens (how many of them are in the KV cache). "Prefilling" and "decoding"
are just num_computed_tokens < num_prompt_tokens or not; the scheduler needs no phases.

The scheduler alone writes this state after it is made (core/scheduling/scheduler.py); what the user sees
(text, logprobs, cumulative outputs) is the output processor's (engine/output_processor.py)."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from twostep.kv_transfer.params import RemotePrefill
from twostep.outputs import RequestMetrics
from twostep.pooling_params import PoolingParams
from twostep.sampling_params import SamplingParams
from twostep.structured_output.grammar import DeferredGrammar, Grammar


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"   # its prompt's KV blocks are being loaded
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    # PoolingParams: a pooling request, prefill only: it ends with its pooled vector when its prompt is
    # computed, generating nothing (vLLM's Request with pooling_params)
    params: SamplingParams | PoolingParams
    metrics: RequestMetrics
    generator: torch.Generator | None = None
    max_total_tokens: int = 0        # prompt + max_tokens, capped at max_model_len
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # prompt_logprobs: prompt positions scored so far (position 0 has none, so it counts as done)
    num_prompt_logprobs: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # Speculative decoding: tokens proposed after the last step, verified by the next one,
    # and the distributions a draft model drew them from ([k, V]; None for n-gram lookup).
    spec_token_ids: list[int] = field(default_factory=list)
    spec_draft_probs: torch.Tensor | None = None
    # Structured outputs: the grammar state after output_token_ids (kept through preemption,
    # since a preempted request keeps its tokens and only recomputes their K/V).
    grammar: Grammar | DeferredGrammar | None = None
    priority: int = 0                # with the priority policy: lower first (vLLM's rule)
    arrival_index: int = 0           # order of arrival, set by the scheduler: ties go first come first
    # Prefill/decode disaggregation: where this request's prompt KV is to be loaded from (a
    # consumer; None once loaded or given up), whether its blocks are kept for a remote decode
    # when it finishes (a producer), and the kv_transfer_params its final output carries.
    remote_prefill: RemotePrefill | None = None
    remote_decode: bool = False
    kv_transfer_params: dict | None = None
    # a pooling request that reads every prompt position's hidden state (MEAN, CLS): no prefix-cache hits
    pools_every_position: bool = False

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        if self.pooling_params is None and self.params.prompt_logprobs is not None:
            self.num_prompt_logprobs = 1

    @property
    def pooling_params(self) -> PoolingParams | None:
        return self.params if isinstance(self.params, PoolingParams) else None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_to_compute(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefilling(self) -> bool:
        return self.num_tokens_to_compute > 1

    @property
    def wants_prompt_logprobs(self) -> bool:
        return (self.pooling_params is None and self.params.prompt_logprobs is not None
                and self.num_prompt_logprobs < self.num_prompt_tokens)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def clear_draft(self) -> None:
        self.spec_token_ids = []
        self.spec_draft_probs = None

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
