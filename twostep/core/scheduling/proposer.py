"""What speculative decoding looks like from the engine core: a Proposer guesses up to k tokens for
requests whose next step is a decode; the scheduler puts them in the next step, which verifies
them. Implementations (n-gram lookup, a draft model, a checkpoint's MTP layer) live in
twostep/spec_decode and are handed to the engine at construction; nothing in core imports them."""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from twostep.core.scheduling.request import Request
from twostep.core.scheduling.scheduler_output import ScheduledRequest
from twostep.core.step_outputs import StepResult

# Draft tokens and the distributions they were drawn from ([k, V]; None for point masses).
Draft = tuple[list[int], "torch.Tensor | None"]


class Proposer(Protocol):
    def propose(self, requests: list[Request], ks: list[int]) -> list[Draft]:
        """Up to ks[i] drafts for requests[i]. Reads the requests' tokens and nothing else of them
        (a draft model samples with their generators, as the target would); the scheduler stores
        the drafts."""
        ...

    def remove(self, request_id: str) -> None:
        """Forget what is held for a request that finished or was preempted."""
        ...


@runtime_checkable
class HiddenStateProposer(Proposer, Protocol):
    """A proposer that drafts from the target's final hidden states (MTP): the runner keeps each
    step's (StepResult.hidden) and the engine hands them over after every step that ran, before it
    asks for drafts (and whether or not it asks)."""

    def observe(self, scheduled: list[ScheduledRequest], results: list[StepResult]) -> None:
        """The step's scheduled requests (updated: their tokens include what the step sampled) and
        the runner's results for them, hidden states included."""
        ...
