"""The messages between the engine core's stages in one step, plain data: the scheduler's plan for
the runner (StepPlan), what the runner computed for it (ModelRunnerOutput) and, after the scheduler
has updated its requests, what changed for each one (EngineCoreOutput, the output processor's
input). The scheduling side (core/scheduling) and the execution side (core/execution) share only
these."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from twostep.kv.state_slots import StateStep
from twostep.outputs import PositionLogprobs
from twostep.pooling_params import PoolingParams
from twostep.sampling_params import SamplingParams


@dataclass(slots=True)
class NewRequestData:
    """A request as the runner first sees it, sent once: when it is first scheduled, or again after
    a preemption made the runner forget it."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]          # generated before (a request resumed after preemption)
    params: SamplingParams | None        # None for a runner that does not sample (tensor-parallel
                                         # workers, a draft model's runner) and for a pooling request:
                                         # no outputs kept either
    generator: torch.Generator | None = None
    pooling: PoolingParams | None = None     # a pooling request: its prompt's hidden states are pooled


@dataclass(slots=True)
class RequestStep:
    """One request's part of a step, as the runner receives it: what changed since it last saw it."""

    request_id: str
    start: int                           # its tokens [start, start + len(token_ids)) are computed
    token_ids: list[int]                 # their ids: known tokens, then num_drafts drafts to verify
    new_blocks: list[list[int]]          # each KV group's block table from index block_start on (earlier: kept)
    block_start: int = 0
    num_drafts: int = 0
    samples: bool = False                # the step completes its known tokens: sample the next one
    decode: bool = False                 # one new token past the prompt (plus drafts): decode work
    prompt_logprobs_from: int | None = None  # first prompt position whose logprobs are still owed
    draft_probs: torch.Tensor | None = None  # the drafts' distributions [num_drafts, V] (draft model)
    token_bitmask: torch.Tensor | None = None  # structured outputs: allowed tokens per sampled position
    state: StateStep | None = None       # a hybrid model's state slots (kv/state_slots.py)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_known_tokens(self) -> int:
        return len(self.token_ids) - self.num_drafts

    @property
    def drafts(self) -> list[int]:
        return self.token_ids[len(self.token_ids) - self.num_drafts:]


@dataclass(slots=True)
class StepPlan:
    """What the scheduler sends its runner for one step (vLLM's SchedulerOutput): requests new to
    the runner once, then per step each scheduled request's tokens and new blocks, and the requests
    to forget. The runner keeps the rest (its requests' tokens, parameters and block tables)."""

    new_requests: list[NewRequestData] = field(default_factory=list)
    steps: list[RequestStep] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)   # finished or preempted since the last plan

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.steps)

    def for_workers(self) -> "StepPlan":
        """The plan as tensor-parallel workers take it: no sampling state (they run the forward only)."""
        new = [NewRequestData(r.request_id, r.prompt_token_ids, [], None) for r in self.new_requests]
        steps = [s if s.draft_probs is None and s.token_bitmask is None
                 else dataclasses.replace(s, draft_probs=None, token_bitmask=None) for s in self.steps]
        return StepPlan(new, steps, self.removed)


@dataclass(slots=True)
class StepResult:
    """What one step computed for one scheduled request."""

    token_ids: list[int] = field(default_factory=list)   # none for a prefill chunk that samples nothing
    logprobs: list[PositionLogprobs | None] | None = None  # one per token when asked for
    prompt_logprobs: list[PositionLogprobs] | None = None
    num_accepted: int = 0                        # drafts the target accepted (the rest roll back)
    # the target's final hidden states (after its final norm) of the tokens the step computed and
    # kept: its known tokens, then the accepted drafts, [n, hidden]; a view of the step's, and only
    # where the runner keeps them (keep_hidden: MTP speculation drafts from them)
    hidden: torch.Tensor | None = None
    # a pooling request whose prompt this step completed: its vector (float32, CPU); it samples nothing
    pooled: torch.Tensor | None = None


@dataclass(slots=True)
class ModelRunnerOutput:
    results: list[StepResult] = field(default_factory=list)   # one per scheduled request, in order


@dataclass(slots=True)
class EngineCoreOutput:
    """One request's change in a step, after the scheduler applied it."""

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[PositionLogprobs | None] | None = None
    new_prompt_logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    stopped_on_token: bool = False   # the last new token is the EOS or stop token that ended it
    kv_transfer_params: dict | None = None   # a producer's finished request: where its blocks wait
    pooled: torch.Tensor | None = None       # a pooling request's vector: it finished with it
