"""Pooling requests' vectors from a step's final hidden states (after the final norm), as vLLM's
pooler makes them. A pooling request's prompt runs in chunks like any other, so what it pools is kept
in the runner's state of the request (request_states.py) from chunk to chunk:

    LAST  the last prompt position's hidden state, in the step that completes the prompt;
    MEAN  every position's, summed in float32 chunk by chunk, divided by the prompt's length at the end;
    CLS   the first position's, kept from the first chunk.

MEAN and CLS need every position computed here: the scheduler gives those requests no prefix-cache hits
(the cache holds K/V, not hidden states). Then the head: an embedding keeps the request's first
`dimensions` values (Matryoshka) and is scaled to unit length; a classifier's score head runs on the
pooled vector, then sigmoid (one label) or softmax, unless the request turns the activation off."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from twostep.config.pooling import PoolingModel
from twostep.core.execution.request_states import RequestState
from twostep.core.step_outputs import RequestStep
from twostep.layers.linear import Linear


class Pooler:
    def __init__(self, spec: PoolingModel, score: Linear | None) -> None:
        if spec.task == "classify" and score is None:
            raise ValueError("a classifying pooler needs the checkpoint's score head")
        self.spec, self.score = spec, score

    def pool(self, hidden: torch.Tensor, steps: list[RequestStep], states: list[RequestState],
             query_start_loc: list[int]) -> dict[int, torch.Tensor]:
        """Take in this step's rows of every pooling request; the vectors of those whose prompt the
        step completes, by their index in the step (float32, on the CPU)."""
        done: list[tuple[int, torch.Tensor, RequestState]] = []
        for i, (s, state) in enumerate(zip(steps, states)):
            if state.pooling is None:
                continue
            rows = hidden[query_start_loc[i]:query_start_loc[i] + s.num_tokens]
            self._take(rows, s, state)
            if s.samples:                # the prompt is complete
                done.append((i, self._pooled(rows, state), state))
        if not done:
            return {}
        if self.spec.task == "classify":
            return self._classify(done, hidden.dtype)
        return {i: self._embedding(v, state) for i, v, state in done}

    def _take(self, rows: torch.Tensor, s: RequestStep, state: RequestState) -> None:
        kind = self.spec.pooling_type
        if kind == "MEAN":
            if s.start != state.pooled_count:
                raise RuntimeError(f"request {s.request_id}: MEAN pooling got positions from {s.start}, after "
                                   f"{state.pooled_count} (a prefix-cache hit must not skip them)")
            part = rows.float().sum(dim=0)
            state.pooled_sum = part if state.pooled_sum is None else state.pooled_sum + part
            state.pooled_count += rows.shape[0]
        elif kind == "CLS" and s.start == 0:
            state.pooled_first = rows[0].float().clone()

    def _pooled(self, rows: torch.Tensor, state: RequestState) -> torch.Tensor:
        kind = self.spec.pooling_type
        if kind == "MEAN":
            return state.pooled_sum / state.pooled_count
        if kind == "CLS":
            if state.pooled_first is None:
                raise RuntimeError("CLS pooling never saw its request's first position")
            return state.pooled_first
        return rows[-1].float()

    def _embedding(self, vector: torch.Tensor, state: RequestState) -> torch.Tensor:
        params = state.pooling
        if params.dimensions is not None:      # Matryoshka: the first d values, then normalised (vLLM's order)
            vector = vector[:params.dimensions]
        normalize = self.spec.normalize if params.normalize is None else params.normalize
        if normalize:
            vector = F.normalize(vector, dim=-1)
        return vector.cpu().contiguous()

    def _classify(self, done: list[tuple[int, torch.Tensor, RequestState]],
                  dtype: torch.dtype) -> dict[int, torch.Tensor]:
        """The score head once over every finished request's pooled vector (in the model's dtype)."""
        logits = self.score(torch.stack([v for _, v, _ in done]).to(dtype)).float()
        out = {}
        for (i, _, state), row in zip(done, logits):
            activation = self.spec.activation if state.pooling.activation is None else state.pooling.activation
            if activation:
                row = torch.sigmoid(row) if row.shape[-1] == 1 else torch.softmax(row, dim=-1)
            out[i] = row.cpu().contiguous()
        return out
