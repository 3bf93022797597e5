"""What flows out of the engine core's stages in one step: the scheduler's plan (SchedulerOutput),
what the model runner computed for it (ModelRunnerOutput) and, after the scheduler has updated
its requests, what changed for each one (EngineCoreOutput, the output processor's input)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from twostep.core.request import Request
from twostep.outputs import PositionLogprobs


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_tokens: int                  # tokens computed for it this step (drafts included)
    start: int                       # its num_computed_tokens before the step
    spec_token_ids: list[int] = field(default_factory=list)   # drafts verified this step
    spec_draft_probs: torch.Tensor | None = None              # their draft distributions [k, V]
    block_ids: list[int] = field(default_factory=list)        # its block table, set by the scheduler
    # Structured outputs: tokens allowed at each sampled position ([1 + drafts, W]), set by the
    # scheduler when this step samples for a constrained request.
    token_bitmask: torch.Tensor | None = None

    @property
    def num_known_tokens(self) -> int:
        return self.num_tokens - len(self.spec_token_ids)

    @property
    def is_decode(self) -> bool:
        """One new token past the prompt (plus drafts to verify); prompt chunks and
        recomputation after preemption are prefill work."""
        return self.num_known_tokens == 1 and self.start >= self.request.num_prompt_tokens

    @property
    def completes_known_tokens(self) -> bool:
        """After this step every known token is cached, so the step samples its next token."""
        return self.start + self.num_known_tokens == self.request.num_tokens

    def input_token_ids(self) -> list[int]:
        """Tokens start .. start + num_tokens of the request's tokens followed by the drafts."""
        known, end = self.request.all_token_ids, self.start + self.num_tokens
        head = known[self.start:end] if self.start < len(known) else []
        if end <= len(known):
            return head
        return head + self.spec_token_ids[max(self.start - len(known), 0):end - len(known)]


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)   # ended while scheduling (no room, ever)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class StepResult:
    """What one step computed for one scheduled request."""

    token_ids: list[int] = field(default_factory=list)   # none for a prefill chunk that samples nothing
    logprobs: list[PositionLogprobs | None] | None = None  # one per token when asked for
    prompt_logprobs: list[PositionLogprobs] | None = None
    num_accepted: int = 0                        # drafts the target accepted (the rest roll back)


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
