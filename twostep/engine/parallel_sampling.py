"""n > 1: one user request fans out into n independent child requests whose completions are
merged back into one RequestOutput (each child keeps its own seed: seed + index)."""
from __future__ import annotations

import dataclasses

from twostep.outputs import CompletionOutput, RequestOutput
from twostep.sampling_params import SamplingParams


def child_id(parent_id: str, index: int) -> str:
    return f"{parent_id}#{index}"


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    seed = None if params.seed is None else params.seed + index
    return dataclasses.replace(params, n=1, seed=seed)


class ParentRequest:
    def __init__(self, request_id: str, n: int) -> None:
        self.request_id = request_id
        self.child_ids = [child_id(request_id, i) for i in range(n)]
        self.completions: list[CompletionOutput | None] = [None] * n
        self.finished = [False] * n

    def index_of(self, child: str) -> int:
        return self.child_ids.index(child)

    def merge(self, child_output: RequestOutput) -> RequestOutput:
        """Fold one child's output in. Every completion is cumulative; only the child that
        changed carries deltas, so a streaming reader never sees the same delta twice."""
        i = self.index_of(child_output.request_id)
        changed = dataclasses.replace(child_output.outputs[0], index=i)
        self.completions[i] = changed
        self.finished[i] = child_output.finished
        outputs = []
        for j, c in enumerate(self.completions):
            if c is None:
                continue
            outputs.append(c if j == i else dataclasses.replace(c, delta_text="", delta_token_ids=[]))
        return dataclasses.replace(child_output, request_id=self.request_id, outputs=outputs,
                                   finished=all(self.finished))
