"""Verify draft tokens against the target so the output is exactly the target's.

For a request with drafts d_1..d_k, the target's logits at its k+1 verified positions give
distributions p_1..p_{k+1} (after penalties, temperature, top-k/top-p/min-p, as the Sampler
would draw from; position i's history includes d_1..d_{i-1}). The draft proposed d_i from
q_i (a point mass for n-gram lookup). In order, d_i is accepted with probability
min(1, p_i(d_i) / q_i(d_i)); the first rejected position instead draws from the residual
max(0, p_i - q_i), renormalised, and verification stops there. If every draft is accepted,
a bonus token is drawn from p_{k+1}. Each emitted token is then distributed exactly as the
target alone would produce it (Leviathan et al., 2023; Chen et al., 2023).

Greedy requests are the limit of this rule: accept while d_i equals the target's argmax,
then emit the argmax, so the output is token-identical to decoding without speculation.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from twostep.sample.sampler import Sampler, SamplingRow, _sample_logprobs, apply_penalties
from twostep.outputs import PositionLogprobs


@dataclass(slots=True)
class DraftRow:
    """One speculating request in a verification step."""

    row: SamplingRow                         # the request's params, history and generator
    draft_token_ids: list[int]
    draft_probs: torch.Tensor | None = None  # [k, V] from a draft model; None: point masses
    token_bitmask: torch.Tensor | None = None  # structured outputs: [k + 1, W], one per position


@dataclass(slots=True)
class Verified:
    token_ids: list[int]                     # accepted drafts, then one token of the target's
    num_accepted: int
    logprobs: list[PositionLogprobs] | None = None


def position_rows(row: SamplingRow, drafts: list[int],
                  token_bitmask: torch.Tensor | None = None) -> list[SamplingRow]:
    """The sampling row of each verified position: its history includes the drafts before it,
    and its grammar bitmask (when constrained) is the one after those drafts."""
    return [SamplingRow(row.params, row.prompt_token_ids, row.output_token_ids + drafts[:i],
                        row.generator, None if token_bitmask is None else token_bitmask[i])
            for i in range(len(drafts) + 1)]


class RejectionSampler:
    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler

    def __call__(self, logits: torch.Tensor, drafts: list[DraftRow]) -> list[Verified]:
        """logits: [sum(k_i + 1), V], each request's k_i + 1 positions in order."""
        rows = [r for d in drafts for r in position_rows(d.row, d.draft_token_ids, d.token_bitmask)]
        if logits.shape[0] != len(rows):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(rows)} verified positions")
        raw = logits.float()
        x = apply_penalties(raw, rows)
        argmax = self.sampler.argmax(x).tolist()
        probs = self._target_probs(x, rows)
        out: list[Verified] = []
        offset = 0
        for d in drafts:
            k = len(d.draft_token_ids)
            if d.row.params.greedy:
                out.append(_verify_greedy(d.draft_token_ids, argmax[offset:offset + k + 1]))
            else:
                out.append(self._verify_sampled(d, probs[offset:offset + k + 1]))
            offset += k + 1
        self._add_logprobs(raw, rows, drafts, out)
        return out

    def _target_probs(self, x: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor | None:
        """Normalised distributions of the sampled rows, zeros for greedy ones."""
        sampled, p = sampled_probs(self.sampler, x, rows)
        if not sampled:
            return None
        probs = torch.zeros_like(x)
        probs[torch.tensor(sampled, device=x.device)] = p
        return probs

    def _verify_sampled(self, d: DraftRow, p: torch.Tensor) -> Verified:
        drafts = d.draft_token_ids
        k = len(drafts)
        gen = self._generator(d.row)
        ids = torch.tensor(drafts, device=p.device)
        q = d.draft_probs if d.draft_probs is not None else _point_masses(ids, p.shape[1], p.dtype)
        q = q.to(device=p.device, dtype=p.dtype)
        positions = torch.arange(k, device=p.device)
        p_d, q_d = p[positions, ids], q[positions, ids]
        u = torch.rand(k, generator=gen, device=_where(gen, p)).to(p.device)
        accepted = (u * q_d < p_d).tolist()  # u < p/q without dividing by q
        a = accepted.index(False) if False in accepted else k
        if a < k:
            residual = (p[a] - q[a]).clamp_(min=0.0)
            if not residual.sum() > 0:               # only by rounding: p and q coincide
                residual = p[a]
            token = _draw(residual, gen)
        else:
            token = _draw(p[k], gen)
        return Verified(drafts[:a] + [token], a)

    def _generator(self, row: SamplingRow) -> torch.Generator | None:
        return row.generator if row.generator is not None else self.sampler.generator

    @staticmethod
    def _add_logprobs(raw: torch.Tensor, rows: list[SamplingRow], drafts: list[DraftRow],
                      out: list[Verified]) -> None:
        """Logprobs of every emitted token at its own position, from the raw logits."""
        picked_rows, picked_tokens, owners = [], [], []
        offset = 0
        for j, (d, v) in enumerate(zip(drafts, out)):
            if d.row.params.logprobs is not None:
                picked_rows.extend(range(offset, offset + len(v.token_ids)))
                picked_tokens.extend(v.token_ids)
                owners.extend([j] * len(v.token_ids))
            offset += len(d.draft_token_ids) + 1
        if not picked_rows:
            return
        idx = torch.tensor(picked_rows, device=raw.device)
        entries = _sample_logprobs(raw[idx], [rows[i] for i in picked_rows],
                                   torch.tensor(picked_tokens, device=raw.device))
        for j, entry in zip(owners, entries):
            if out[j].logprobs is None:
                out[j].logprobs = []
            out[j].logprobs.append(entry)


def draft_sample(sampler: Sampler, logits: torch.Tensor, rows: list[SamplingRow]
                 ) -> tuple[list[int], list[torch.Tensor | None]]:
    """A draft model's pick for each row, with the distribution it drew from (None for greedy
    rows, which take the argmax of the penalised logits as the target will)."""
    x = apply_penalties(logits.float(), rows)
    tokens = sampler.argmax(x).tolist()
    dists: list[torch.Tensor | None] = [None] * len(rows)
    sampled, p = sampled_probs(sampler, x, rows)
    for j, i in enumerate(sampled):
        gen = rows[i].generator if rows[i].generator is not None else sampler.generator
        tokens[i] = _draw(p[j], gen)
        dists[i] = p[j]
    return tokens, dists


def sampled_probs(sampler: Sampler, x: torch.Tensor, rows: list[SamplingRow]
                  ) -> tuple[list[int], torch.Tensor | None]:
    """The rows that sample (not greedy) and their normalised distributions, given penalised logits."""
    sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
    if not sampled:
        return sampled, None
    p = sampler.filtered_probs(x[torch.tensor(sampled, device=x.device)], [rows[i] for i in sampled])
    return sampled, p / p.sum(dim=-1, keepdim=True)


def _verify_greedy(drafts: list[int], argmax: list[int]) -> Verified:
    a = 0
    while a < len(drafts) and drafts[a] == argmax[a]:
        a += 1
    return Verified(drafts[:a] + [argmax[a]], a)


def _point_masses(ids: torch.Tensor, vocab: int, dtype: torch.dtype) -> torch.Tensor:
    q = torch.zeros(len(ids), vocab, dtype=dtype, device=ids.device)
    q[torch.arange(len(ids), device=ids.device), ids] = 1.0
    return q


def _where(gen: torch.Generator | None, like: torch.Tensor) -> torch.device:
    return gen.device if gen is not None else like.device


def _draw(weights: torch.Tensor, gen: torch.Generator | None) -> int:
    """One token with probability weights[i] / sum(weights): the exponential race."""
    noise = torch.empty(weights.shape, device=_where(gen, weights)).exponential_(generator=gen)
    noise = noise.to(weights.device).clamp_(min=torch.finfo(noise.dtype).tiny)
    return int((weights / noise).argmax())
