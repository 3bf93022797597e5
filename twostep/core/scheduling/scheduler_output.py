"""The scheduler's own view of a step: the requests it scheduled (live Request objects, which only
the scheduling side reads), those it preempted or ended while scheduling, and the plan it sends the
runner (core/step_outputs.py's StepPlan, plain data)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from twostep.core.scheduling.request import Request
from twostep.core.step_outputs import StepPlan
from twostep.kv.state_slots import StateStep


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_tokens: int                  # tokens computed for it this step (drafts included)
    start: int                       # its num_computed_tokens before the step
    spec_token_ids: list[int] = field(default_factory=list)   # drafts verified this step
    spec_draft_probs: torch.Tensor | None = None              # their draft distributions [k, V]
    tables: list[list[int]] = field(default_factory=list)     # its block table in each KV group, set by the scheduler
    # Structured outputs: tokens allowed at each sampled position ([1 + drafts, W]), set by the
    # scheduler when this step samples for a constrained request.
    token_bitmask: torch.Tensor | None = None
    state: StateStep | None = None       # a hybrid model's state slots this step, set by the scheduler

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
    plan: StepPlan = field(default_factory=StepPlan)        # the step as the runner receives it

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
