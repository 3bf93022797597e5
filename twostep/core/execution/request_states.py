"""The model runner's own state of its requests (vLLM's CachedRequestState and persistent batch): each
request's tokens, sampling parameters and block table, kept from step to step and updated only from
the scheduler's StepPlan (core/step_outputs.py). The runner reads no scheduler state."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from twostep.core.step_outputs import NewRequestData, RequestStep, StepPlan
from twostep.pooling_params import PoolingParams
from twostep.sampling_params import SamplingParams


@dataclass(slots=True)
class RequestState:
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    params: SamplingParams | None
    generator: torch.Generator | None
    tables: list[list[int]] = field(default_factory=list)     # a block table per KV group
    pooling: PoolingParams | None = None
    # a pooling request's hidden states so far (core/execution/pooler.py): MEAN's float32 sum and how
    # many positions it holds, CLS's first position
    pooled_sum: torch.Tensor | None = None
    pooled_count: int = 0
    pooled_first: torch.Tensor | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def apply(self, step: RequestStep) -> None:
        """The step's new blocks, and its known tokens past the prompt as outputs (a decode's input
        is the token sampled last step). A runner that does not sample keeps no outputs."""
        if not self.tables:
            self.tables = [[] for _ in step.new_blocks]
        if step.block_start > len(self.tables[0]):
            raise RuntimeError(f"request {step.request_id}: blocks from {step.block_start} sent, the runner has "
                               f"{len(self.tables[0])}")
        for table, new in zip(self.tables, step.new_blocks, strict=True):
            table[step.block_start:] = new
        if self.params is None:
            return
        outputs, prompt = self.output_token_ids, self.num_prompt_tokens
        for position in range(max(step.start, prompt), step.start + step.num_known_tokens):
            index, token = position - prompt, step.token_ids[position - step.start]
            if index < len(outputs):
                outputs[index] = token
            elif index == len(outputs):
                outputs.append(token)
            else:
                raise RuntimeError(f"request {step.request_id}: output {index} sent, the runner has {len(outputs)}")


class RequestStates(dict[str, RequestState]):
    """The runner's requests by id."""

    def apply(self, plan: StepPlan) -> list[RequestState]:
        """Forget the removed requests, add the new ones, apply each step; the scheduled requests'
        states, in the plan's order."""
        for request_id in plan.removed:
            self.pop(request_id, None)
        for new in plan.new_requests:
            self[new.request_id] = _state(new)
        states = [self[s.request_id] for s in plan.steps]
        for state, step in zip(states, plan.steps):
            state.apply(step)
        return states


def _state(new: NewRequestData) -> RequestState:
    return RequestState(new.prompt_token_ids, new.output_token_ids, new.params, new.generator, pooling=new.pooling)
