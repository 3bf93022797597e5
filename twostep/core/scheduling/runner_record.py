"""The scheduler's record of what its model runner holds: which requests it has seen, and how much
of each one's block table. From it each step's StepPlan carries only what changed (vLLM's
NewRequestData once, then per-step diffs), and the runner keeps the rest in its own state."""
from __future__ import annotations

from twostep.core.scheduling.scheduler_output import ScheduledRequest
from twostep.core.step_outputs import NewRequestData, RequestStep, StepPlan


class RunnerRecord:
    def __init__(self, samples: bool = True) -> None:
        self.samples = samples                # whether the runner samples (needs params and outputs)
        self._blocks: dict[str, int] = {}     # request id -> leading blocks of its table the runner has
        self._removed: list[str] = []         # forgotten since the last plan

    def forget(self, request_id: str) -> None:
        """The request finished or was preempted (its blocks freed): the runner drops it."""
        if self._blocks.pop(request_id, None) is not None:
            self._removed.append(request_id)

    def trimmed(self, request_id: str, num_blocks: int) -> None:
        """Its table was cut to num_blocks (rejected drafts' slots rolled back): later blocks are new."""
        if request_id in self._blocks:
            self._blocks[request_id] = min(self._blocks[request_id], num_blocks)

    def plan(self, scheduled: list[ScheduledRequest]) -> StepPlan:
        """The runner's message for these scheduled requests (their tables set)."""
        plan = StepPlan(removed=self._removed)
        self._removed = []
        for s in scheduled:
            request, tables = s.request, s.tables
            rid = request.request_id
            if rid not in self._blocks:
                pooling = request.pooling_params
                plan.new_requests.append(
                    NewRequestData(rid, request.prompt_token_ids, [], None, pooling=pooling) if pooling is not None
                    else NewRequestData(rid, request.prompt_token_ids, list(request.output_token_ids),
                                        request.params, request.generator) if self.samples
                    else NewRequestData(rid, request.prompt_token_ids, [], None))
                self._blocks[rid] = 0
            first = min(self._blocks[rid], len(tables[0]))
            self._blocks[rid] = len(tables[0])
            plan.steps.append(RequestStep(
                rid, s.start, s.input_token_ids(), new_blocks=[t[first:] for t in tables], block_start=first,
                num_drafts=len(s.spec_token_ids), samples=s.completes_known_tokens, decode=s.is_decode,
                prompt_logprobs_from=request.num_prompt_logprobs if request.wants_prompt_logprobs else None,
                draft_probs=s.spec_draft_probs, token_bitmask=s.token_bitmask, state=s.state))
        return plan
