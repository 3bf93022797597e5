"""How much KV cache a context and a concurrency need, and how much fits next to the weights.

Weights and KV only: activations, the allocator's slack and the runtime's own memory come on top,
so the maxima here are upper bounds. The weights are all of them: a mixture-of-experts model keeps
every expert resident (its total N, not the active N' a token runs through).

A hybrid model (Qwen3.5, Qwen3-Next) also keeps a linear-attention state of s bytes per sequence,
whatever its context: N sequences of S tokens need weights + N x s + N x S x k (k over the attention
layers only; a sliding-window layer holds its window).
"""
from __future__ import annotations

from dataclasses import dataclass

from twostep.analysis.model_stats import ModelStats


@dataclass(slots=True, frozen=True)
class MemoryPlan:
    budget: int
    weight_bytes: float
    kv_budget: float            # budget - weights, for K/V and states; negative when the weights alone do not fit
    context: int
    concurrency: int
    kv_bytes: int               # k x context x concurrency (a sliding-window layer: its window)
    state_bytes: int            # s x concurrency: a hybrid's linear-attention states (0: none)
    fits: bool                  # weights + that KV + those states within the budget
    max_tokens: int             # KV tokens that fit in all, over every sequence, beside `concurrency` states
    max_context: int            # per sequence, with `concurrency` sequences
    max_concurrency: int        # sequences of `context` tokens, each with its state
    model_max_context: int      # the model's max_position_embeddings, for comparison


def plan_memory(m: ModelStats, budget: int, context: int, concurrency: int) -> MemoryPlan:
    k = m.kv.bytes_per_token
    kv_budget = budget - m.weight_bytes         # N x b: every expert, however few a token takes
    per_sequence = m.sequence_bytes(context)    # its K/V and a hybrid's state
    kv_bytes = m.kv.bytes_at(context) * concurrency
    state_bytes = m.state.bytes_per_sequence * concurrency
    token_budget = kv_budget - state_bytes      # what K/V may take once the sequences' states are held
    max_tokens = int(token_budget // k) if token_budget > 0 and k else 0
    return MemoryPlan(
        budget=budget, weight_bytes=m.weight_bytes, kv_budget=kv_budget, context=context,
        concurrency=concurrency, kv_bytes=kv_bytes, state_bytes=state_bytes,
        fits=kv_bytes + state_bytes <= kv_budget, max_tokens=max_tokens,
        max_context=_longest_context(m, token_budget / concurrency),
        max_concurrency=int(kv_budget // per_sequence) if kv_budget > 0 else 0, model_max_context=m.max_context,
    )


def _longest_context(m: ModelStats, budget: float) -> int:
    """The longest context whose K/V fits the budget (sliding windows make it grow faster than 1/k)."""
    if budget < 0:
        return 0
    if not m.kv.bytes_per_token:        # no layer keeps K/V: the context costs no memory
        return m.max_context
    if not m.kv.windowed:
        return int(budget // m.kv.bytes_per_token)
    low, high = 0, 1 << 40
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if m.kv.bytes_at(mid) <= budget else (low, mid - 1)
    return low
