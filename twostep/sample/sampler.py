"""Pick the next token for every sequence in a batch, and report logprobs.

The model hands over logits ``[B, V]``; row ``i`` belongs to ``rows[i]``, a
:class:`SamplingRow` (the sequence's :class:`SamplingParams`, its prompt and output
token ids so far, and its own random generator when the request is seeded).
The input tensor is never modified.

Per row, in this order:

0. Constraints (sample/constraints.py): the grammar's bitmask (structured outputs),
   ``allowed_token_ids`` and ``bad_words`` set the logits of tokens that may not come next to
   ``-inf``; ``logit_bias`` is added.
1. ``min_tokens``: while ``len(output_token_ids) < min_tokens``, the logits of
   ``all_stop_token_ids`` (the EOS ids) and ``stop_token_ids`` are set to ``-inf``.
2. Penalties. ``repetition_penalty`` (HF/CTRL style) over every distinct token in
   prompt + output: a positive logit is divided by the penalty, a negative one
   multiplied by it. Then ``presence_penalty`` and ``frequency_penalty`` (OpenAI
   style) over the output tokens only:
   ``logit -= presence * (count > 0) + frequency * count``.
   Steps 0 to 2 are :func:`apply_penalties`.
3. Greedy rows (``temperature < GREEDY_TEMPERATURE``, i.e. 0 in practice; tinier
   temperatures would only overflow the division): argmax of the penalised
   logits, ties to the lowest token id.
4. Every other row: divide by the temperature, then
   - ``top_k``: keep the k highest logits, plus any tied with the k-th (so the
     kept set never depends on how a sort orders equal values);
   - ``top_p``: keep the smallest set of highest-probability tokens whose
     cumulative probability reaches ``top_p`` (always at least one token). A token
     is dropped once the probability mass strictly before it is
     ``>= top_p - TOP_P_TOLERANCE``, so a boundary case such as 0.5 + 0.3 against
     ``top_p=0.8`` is not decided by float rounding;
   - ``min_p``: drop tokens whose probability is below ``min_p * max probability``;
   - draw from the renormalised distribution with the exponential race
     ``argmax(p / E)``, ``E ~ Exponential(1)`` i.i.d. per vocabulary entry (the
     winner is token ``i`` with probability ``p_i / sum(p)``, so no
     renormalisation or cumulative search is needed).

Randomness. A row with its own generator (a seeded request) draws its noise as a
fresh ``[V]`` tensor from that generator, so its tokens depend only on its seed and
its own history, never on what else is in the batch or on its row index. Rows
without one share a single ``[n, V]`` draw from the sampler's generator (torch's
global RNG when the sampler has none). Generators should live on the logits'
device; one elsewhere still works, at the cost of a copy.

Batch work is vectorised: min_tokens is one indexed write, the penalties are one
scatter over a padded ``[rows, max_len]`` id tensor, rows with top_p < 1 share one
(stable) sort that also serves their top_k, rows with only top_k use ``topk``
instead of a sort, and the only Python loops run over rows (or over a
row's top-N logprobs), never over the vocabulary. When every row is greedy and no
row has min_tokens or a penalty in force, the work is a single argmax (plus the
logprobs if asked for).

Logprobs (``params.logprobs`` not None) come from the RAW logits, the
``log_softmax`` of the model's output before min_tokens, penalties, temperature and
filtering (vLLM's default). Each position holds the sampled token plus the top-N
ids; ``rank`` is 1 + the number of tokens with a strictly higher logprob, so tied
tokens share a rank.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import Callable

import torch

from twostep.outputs import Logprob, PositionLogprobs
from twostep.sample.argmax import first_argmax
from twostep.sample.constraints import apply_constraints
from twostep.sampling_params import SamplingParams

# Temperatures below this are treated as greedy (as vLLM does with its _SAMPLING_EPS).
# Slack on the top_p comparison, so exact boundaries are not decided by rounding.
TOP_P_TOLERANCE = 1e-6
# prompt_logprobs works through this many positions at a time to bound memory.
PROMPT_LOGPROBS_CHUNK = 1024

_NEG_INF = float("-inf")


@dataclass(slots=True)
class SamplingRow:
    """One sequence's row in the batch's logits."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    # Per-request generator seeded from params.seed (see make_generator);
    # None -> the Sampler's default generator.
    generator: torch.Generator | None = None
    # Structured outputs: the tokens the grammar allows next, packed int32 [ceil(V / 32)].
    token_bitmask: torch.Tensor | None = None


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]                      # one per row
    logprobs: list[PositionLogprobs | None]   # per row; None unless params.logprobs is set


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """The per-request generator for ``params.seed`` (None when unseeded).

    Create it on the device the logits will be on.
    """
    if seed is None:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


def is_greedy(params: SamplingParams) -> bool:
    """Whether the sampler takes the argmax for these params."""
    return params.greedy


def _padded_ids(parts_per_row: list[tuple[list[int], ...]], pad: int, device: torch.device) -> torch.Tensor:
    """Token ids of each row (the concatenation of its parts) as ``[rows, max_len]``,
    padded with ``pad``; ids ``>= pad`` also become ``pad`` (a dummy column)."""
    lengths = [sum(len(p) for p in parts) for parts in parts_per_row]
    width = max(lengths, default=0)
    out = torch.full((len(parts_per_row), width), pad, dtype=torch.long)
    if width:
        flat = torch.tensor(list(chain.from_iterable(chain.from_iterable(parts_per_row))), dtype=torch.long)
        filled = torch.arange(width) < torch.tensor(lengths).unsqueeze(1)
        out[filled] = flat   # boolean-mask assignment fills row-major: matches the chain order
        out.clamp_(max=pad)
    return out.to(device)


def _apply_min_tokens_(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    vocab = logits.shape[1]
    row_idx: list[int] = []
    col_idx: list[int] = []
    for i, row in enumerate(rows):
        p = row.params
        if len(row.output_token_ids) < p.min_tokens:
            ids = [t for t in set(p.all_stop_token_ids).union(p.stop_token_ids) if 0 <= t < vocab]
            row_idx.extend([i] * len(ids))
            col_idx.extend(ids)
    if row_idx:
        dev = logits.device
        logits[torch.tensor(row_idx, device=dev), torch.tensor(col_idx, device=dev)] = _NEG_INF


def _apply_repetition_penalty_(logits: torch.Tensor, rows: list[SamplingRow], which: list[int]) -> None:
    dev, vocab = logits.device, logits.shape[1]
    ids = _padded_ids([(rows[i].prompt_token_ids, rows[i].output_token_ids) for i in which], vocab, dev)
    seen = torch.zeros(len(which), vocab + 1, dtype=torch.bool, device=dev)
    seen.scatter_(1, ids, True)
    seen = seen[:, :vocab]
    penalty = torch.tensor([rows[i].params.repetition_penalty for i in which],
                           dtype=logits.dtype, device=dev).unsqueeze(1)
    idx = torch.tensor(which, device=dev)
    x = logits[idx]
    logits[idx] = torch.where(seen, torch.where(x > 0, x / penalty, x * penalty), x)


def _apply_presence_frequency_(logits: torch.Tensor, rows: list[SamplingRow], which: list[int]) -> None:
    dev, vocab = logits.device, logits.shape[1]
    ids = _padded_ids([(rows[i].output_token_ids,) for i in which], vocab, dev)
    if ids.shape[1] == 0:
        return   # no row has output yet
    counts = torch.zeros(len(which), vocab + 1, dtype=logits.dtype, device=dev)
    counts.scatter_add_(1, ids, torch.ones(ids.shape, dtype=logits.dtype, device=dev))
    counts = counts[:, :vocab]
    presence = torch.tensor([rows[i].params.presence_penalty for i in which], dtype=logits.dtype, device=dev)
    frequency = torch.tensor([rows[i].params.frequency_penalty for i in which], dtype=logits.dtype, device=dev)
    idx = torch.tensor(which, device=dev)
    logits[idx] = logits[idx] - (frequency.unsqueeze(1) * counts + presence.unsqueeze(1) * (counts > 0))


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Steps 0 to 2 of the module docstring: constraints, min_tokens, then repetition, presence
    and frequency penalties. Returns a new tensor, or ``logits`` itself when no row
    needs any change; never modifies ``logits``."""
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits {tuple(logits.shape)} do not match {len(rows)} rows")
    return _apply_penalties(apply_constraints(logits, rows), rows)


def _apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    blocks = any(len(r.output_token_ids) < r.params.min_tokens for r in rows)
    rep = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
    pres_freq = [i for i, r in enumerate(rows)
                 if r.params.presence_penalty != 0.0 or r.params.frequency_penalty != 0.0]
    if not (blocks or rep or pres_freq):
        return logits
    out = logits.clone()
    if blocks:
        _apply_min_tokens_(out, rows)
    if rep:
        _apply_repetition_penalty_(out, rows, rep)
    if pres_freq:
        _apply_presence_frequency_(out, rows, pres_freq)
    return out


def _effective_top_k(params: SamplingParams, vocab: int) -> int:
    return params.top_k if 0 < params.top_k < vocab else vocab


def _top_k_drop(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Boolean ``[n, V]``: the tokens top_k removes, without a full sort."""
    vocab = x.shape[1]
    ks = torch.tensor([_effective_top_k(p, vocab) for p in params], device=x.device)
    top = x.topk(int(ks.max()), dim=-1).values
    kth = top.gather(1, (ks - 1).unsqueeze(1))
    return x < kth


def _top_k_top_p_drop(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Boolean ``[n, V]``: the tokens top_k and then top_p remove, with one sort."""
    vocab = x.shape[1]
    dev = x.device
    # stable: which of several tied tokens the nucleus boundary keeps is fixed (lowest id).
    sorted_x, order = x.sort(dim=-1, descending=True, stable=True)
    ks = torch.tensor([_effective_top_k(p, vocab) for p in params], device=dev)
    drop = sorted_x < sorted_x.gather(1, (ks - 1).unsqueeze(1))
    probs = sorted_x.masked_fill(drop, _NEG_INF).softmax(dim=-1)
    before = torch.zeros_like(probs)        # probability mass strictly before each position
    before[:, 1:] = probs[:, :-1].cumsum(dim=-1)
    limit = torch.tensor([p.top_p - TOP_P_TOLERANCE if p.top_p < 1.0 else float("inf") for p in params],
                         dtype=probs.dtype, device=dev).unsqueeze(1)
    nucleus_drop = before >= limit
    nucleus_drop[:, 0] = False               # the most likely token always stays
    drop |= nucleus_drop
    return torch.zeros_like(drop).scatter_(1, order, drop)


class Sampler:
    """Turns a batch of logits into one token per row (see the module docstring)."""

    def __init__(self, generator: torch.Generator | None = None,
                 argmax: Callable[[torch.Tensor], torch.Tensor] | None = None):
        # For rows without their own generator; None -> torch's global RNG.
        self.generator = generator
        # [rows, V] float32 -> [rows] int64, each row's first maximum: the platform's one-call
        # kernel where it has one (the same answers as first_argmax)
        self.argmax = argmax or first_argmax

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(rows)} rows")
        if logits.dtype != torch.float32:
            logits = logits.float()
        raw = logits
        x = apply_penalties(logits, rows)
        sampled = [i for i, r in enumerate(rows) if not is_greedy(r.params)]
        if not sampled:
            tokens = self.argmax(x)
        elif len(sampled) == len(rows):
            tokens = self._sample(x, rows)
        else:
            dev = x.device
            sampled_set = set(sampled)
            greedy_idx = torch.tensor([i for i in range(len(rows)) if i not in sampled_set], device=dev)
            sampled_idx = torch.tensor(sampled, device=dev)
            tokens = torch.empty(len(rows), dtype=torch.long, device=dev)
            tokens[greedy_idx] = self.argmax(x[greedy_idx])
            tokens[sampled_idx] = self._sample(x[sampled_idx], [rows[i] for i in sampled])
        return SamplerOutput(token_ids=tokens.tolist(), logprobs=_sample_logprobs(raw, rows, tokens))

    def _sample(self, x: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Step 4 for rows that all sample; returns their token ids ``[n]``."""
        probs = self.filtered_probs(x, rows)
        return self.argmax(probs.div_(self._noise(rows, x.shape[1], x.device)))

    def filtered_probs(self, x: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Step 4 up to the draw: the distribution ``[n, V]`` sampled rows draw from, given
        penalised logits ``x`` (min_p leaves it unnormalised: divide by its sum for p)."""
        n, vocab = x.shape
        dev = x.device
        temperature = torch.tensor([r.params.temperature for r in rows], dtype=x.dtype, device=dev)
        x = x / temperature.unsqueeze(1)   # a new tensor: in-place edits below are safe
        nucleus = [j for j, r in enumerate(rows) if r.params.top_p < 1.0]
        top_k_only = [j for j, r in enumerate(rows) if r.params.top_p >= 1.0 and 0 < r.params.top_k < vocab]
        for which, drop_fn in ((nucleus, _top_k_top_p_drop), (top_k_only, _top_k_drop)):
            if len(which) == n:
                x.masked_fill_(drop_fn(x, [r.params for r in rows]), _NEG_INF)
            elif which:
                idx = torch.tensor(which, device=dev)
                sub = x[idx]
                x[idx] = sub.masked_fill(drop_fn(sub, [rows[j].params for j in which]), _NEG_INF)
        probs = x.softmax(dim=-1)
        if any(r.params.min_p > 0.0 for r in rows):
            min_p = torch.tensor([r.params.min_p for r in rows], dtype=probs.dtype, device=dev)
            floor = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
            probs.masked_fill_(probs < floor, 0.0)
        return probs

    def _noise(self, rows: list[SamplingRow], vocab: int, device: torch.device) -> torch.Tensor:
        """Exponential(1) noise ``[n, V]``: seeded rows from their own generator, one
        ``[V]`` draw each; the rest in one draw from the sampler's generator."""
        shared = [j for j, r in enumerate(rows) if r.generator is None]
        if len(shared) == len(rows):
            noise = self._shared_noise(len(rows), vocab, device)
        else:
            noise = torch.empty(len(rows), vocab, device=device)
            if shared:
                noise[torch.tensor(shared, device=device)] = self._shared_noise(len(shared), vocab, device)
            for j, r in enumerate(rows):
                gen = r.generator
                if gen is not None:
                    noise[j] = torch.empty(vocab, device=gen.device).exponential_(generator=gen).to(device)
        # exponential_ may return exactly 0; keep p / E finite for p = 0 (no NaN winner).
        return noise.clamp_(min=torch.finfo(noise.dtype).tiny)

    def _shared_noise(self, n: int, vocab: int, device: torch.device) -> torch.Tensor:
        gen = self.generator
        where = gen.device if gen is not None else device
        return torch.empty(n, vocab, device=where).exponential_(generator=gen).to(device)


def _tie_ranks(values: list[float]) -> list[int]:
    """1-based ranks of descending values, tied values sharing the best rank."""
    ranks: list[int] = []
    for k, v in enumerate(values):
        ranks.append(ranks[-1] if k and v == values[k - 1] else k + 1)
    return ranks


def _positions(
    chosen_ids: list[int], chosen_lp: list[float], chosen_rank: list[int],
    top_ids: list[list[int]], top_lp: list[list[float]], num_top: list[int],
) -> list[PositionLogprobs]:
    """One dict per position: the chosen token first, then its top ``num_top`` ids."""
    out: list[PositionLogprobs] = []
    for t, tok in enumerate(chosen_ids):
        entry: PositionLogprobs = {tok: Logprob(chosen_lp[t], chosen_rank[t])}
        k = num_top[t]
        if k:
            values = top_lp[t][:k]
            for tid, lp, rank in zip(top_ids[t][:k], values, _tie_ranks(values)):
                if tid not in entry:
                    entry[tid] = Logprob(lp, rank)
        out.append(entry)
    return out


def _logprob_rows(logprobs: torch.Tensor, chosen: torch.Tensor, num_top: int):
    """Per row of a ``[n, V]`` log-softmax: chosen token's logprob and rank, and the
    top ``num_top`` (values, ids), all as Python lists."""
    chosen_lp = logprobs.gather(1, chosen.unsqueeze(1))
    ranks = (logprobs > chosen_lp).sum(dim=-1) + 1
    if num_top:
        top_lp, top_ids = logprobs.topk(num_top, dim=-1)
        top = (top_lp.tolist(), top_ids.tolist())
    else:
        top = ([[]] * len(chosen), [[]] * len(chosen))
    return chosen_lp.squeeze(1).tolist(), ranks.tolist(), top[0], top[1]


def _sample_logprobs(raw: torch.Tensor, rows: list[SamplingRow], tokens: torch.Tensor) -> list[PositionLogprobs | None]:
    result: list[PositionLogprobs | None] = [None] * len(rows)
    want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    if not want:
        return result
    vocab = raw.shape[1]
    if len(want) == len(rows):
        sel, chosen = raw, tokens
    else:
        idx = torch.tensor(want, device=raw.device)
        sel, chosen = raw[idx], tokens[idx]
    num_top = [min(rows[i].params.logprobs, vocab) for i in want]
    chosen_lp, ranks, top_lp, top_ids = _logprob_rows(torch.log_softmax(sel, dim=-1), chosen, max(num_top))
    entries = _positions(chosen.tolist(), chosen_lp, ranks, top_ids, top_lp, num_top)
    for i, entry in zip(want, entries):
        result[i] = entry
    return result


def prompt_logprobs(logits: torch.Tensor, target_ids: list[int], num_top: int) -> list[PositionLogprobs]:
    """Logprobs of the prompt's own tokens.

    ``logits[t]`` is the model's output at prompt position t and ``target_ids[t]``
    the prompt token that follows it. Each entry holds the target's Logprob (with
    its rank) plus the top ``num_top`` ids, from the raw ``log_softmax``. Works in
    chunks of ``PROMPT_LOGPROBS_CHUNK`` positions to bound memory.
    """
    if logits.dim() != 2 or logits.shape[0] != len(target_ids):
        raise ValueError(f"logits {tuple(logits.shape)} do not match {len(target_ids)} target ids")
    if num_top < 0:
        raise ValueError(f"num_top must be >= 0, got {num_top}")
    total, vocab = logits.shape
    k = min(num_top, vocab)
    out: list[PositionLogprobs] = []
    for start in range(0, total, PROMPT_LOGPROBS_CHUNK):
        chunk = logits[start:start + PROMPT_LOGPROBS_CHUNK].float()
        targets = target_ids[start:start + PROMPT_LOGPROBS_CHUNK]
        chosen = torch.tensor(targets, dtype=torch.long, device=chunk.device)
        chosen_lp, ranks, top_lp, top_ids = _logprob_rows(torch.log_softmax(chunk, dim=-1), chosen, k)
        out.extend(_positions(targets, chosen_lp, ranks, top_ids, top_lp, [k] * len(targets)))
    return out
