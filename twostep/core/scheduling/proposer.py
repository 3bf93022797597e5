"""What speculative decoding looks like from the engine core: a Proposer guesses up to k tokens for
requests whose next step is a decode; the scheduler puts them in the next step, which verifies
them. Implementations (n-gram lookup, a draft model) live in twostep/spec_decode and are handed to
the engine at construction; nothing in core imports them."""
from __future__ import annotations

from typing import Protocol

import torch

from twostep.core.scheduling.request import Request

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
