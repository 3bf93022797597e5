"""Arithmetic intensity of prefill and decode, the roofline time they cannot beat, and where each
phase turns from memory-bound to compute-bound.

Both phases have one shape (the reference text's formulas): x tokens go through the model sharing
one read of the N weights (N x b bytes), each costs 2N FLOPs and brings c bytes of KV traffic:

    intensity(x) = 2N x / (N b + c x)

prefill: x = S prompt tokens of one sequence, c = k (each writes its K and V);
decode:  x = B sequences of one token each, c = k S (each reads its context's K and V).

Attention's own FLOPs (~4 x layers x heads x head_dim per token pair) are left out, as the text does;
leaving FLOPs out keeps the times below lower bounds.

A mixture-of-experts model (model_stats.py) splits N: each token costs 2N' FLOPs, N' its active
parameters, and the x tokens read the weights of the experts they take, W(x) bytes, from N' b at one
token towards N b (every expert) as x grows; the expected distinct experts per layer is
E (1 - (1 - k/E)^x), for decode's batch of B sequences as for prefill's S tokens:

    intensity(x) = 2N' x / (W(x) + c x)

So decode's bound at batch 1 is the active weight bytes per token, not all of them; a dense model
has N' = N and W(x) = N b, the formula above.

A hybrid model (model_stats.py: Qwen3.5, Qwen3-Next) has K/V in its attention layers only (k counts
those) and a state of s bytes per sequence in its linear-attention layers, the same at any context.
Each sequence reads its state and writes it back once per step: once per token in decode, once for
a prompt prefilled in one step (a kernel that keeps its chunks' states on chip; one that spills each
chunk's adds more, and so does a prompt split over several steps). A linear-attention layer has
no attention scores (the term left out above, which grows with the context); its token costs the
projections (in 2N') and the delta rule's recurrence, a constant (model_stats.DELTA_RULE_FLOPS),
F = 2N' + that in all:

    prefill: F S / (W(S) + kS + 2s)        decode: F B / (W(B) + (kS + 2s) B)

So the state's share of decode's bytes is flat in the context where the K/V's grows with it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from twostep.analysis.hardware import Hardware
from twostep.analysis.model_stats import ModelStats


def intensity(n: float, b: float, c: float, x: float) -> float:
    """FLOP per byte of x tokens sharing one read of the weights, each bringing c bytes of KV."""
    return 2 * n * x / (n * b + c * x)


def prefill_intensity(n: float, b: float, k: float, prompt_len: int) -> float:
    """2NS / (Nb + kS): grows with S, towards 2N/k."""
    return intensity(n, b, k, prompt_len)


def decode_intensity(n: float, b: float, k: float, context: int, batch: int = 1) -> float:
    """2NB / (Nb + kSB): at most 2/b for one sequence (~1 FLOP/byte in bf16), towards 2N/(kS) as
    the batch grows."""
    return intensity(n, b, k * context, batch)


def first_compute_bound(n: float, b: float, c: float, ridge: float) -> int | None:
    """The smallest whole x with intensity(x) >= ridge, or None if even x -> infinity stays under it.

    Solving 2Nx / (Nb + cx) >= R gives x >= R N b / (2N - R c) when 2N > R c.
    """
    if 2 * n <= ridge * c:
        return None
    x = max(1, math.ceil(ridge * n * b / (2 * n - ridge * c)))
    # The closed form is exact in reals; step off float rounding at the boundary.
    while x > 1 and intensity(n, b, c, x - 1) >= ridge:
        x -= 1
    while intensity(n, b, c, x) < ridge:
        x += 1
    return x


@dataclass(slots=True, frozen=True)
class PhasePoint:
    phase: str                  # "prefill" or "decode"
    tokens: int                 # prefill: prompt length S; decode: context S of each sequence
    batch: int                  # sequences: 1 for prefill, B for decode
    flops: float
    bytes: float                # weight_bytes + kv_bytes + state_bytes
    weight_bytes: float         # the weights read (a MoE model: the experts these tokens take)
    kv_bytes: float             # K/V written (prefill) or read (decode), attention layers only
    state_bytes: float          # a hybrid's linear-attention state, read and written once per step
    intensity: float
    bound: str                  # "compute" or "memory"
    attainable_flops: float     # the roof at this intensity: min(peak, intensity x bandwidth)
    time_s: float               # lower bound: TTFT for prefill, TPOT for decode
    tokens_per_s: float         # upper bound: prompt tokens/s for prefill, generated tokens/s for decode


def prefill_point(m: ModelStats, hw: Hardware, prompt_len: int) -> PhasePoint:
    flops = m.flops_per_token * prompt_len
    # a hybrid's state: read at the prompt's start and written at its end, once for the sequence
    nbytes = (m.weight_bytes_read(prompt_len), m.kv.bytes_at(prompt_len), 2 * m.state.bytes_per_sequence)
    return _point("prefill", prompt_len, 1, flops, nbytes, hw, new_tokens=prompt_len)


def decode_point(m: ModelStats, hw: Hardware, context: int, batch: int) -> PhasePoint:
    flops = m.flops_per_token * batch
    # a MoE model: the experts the batch's B tokens take, E (1 - (1 - k/E)^B) per layer expected;
    # each sequence reads its context's K/V and reads and writes a hybrid's state
    nbytes = (m.weight_bytes_read(batch), m.kv.bytes_at(context) * batch,
              2 * m.state.bytes_per_sequence * batch)
    return _point("decode", context, batch, flops, nbytes, hw, new_tokens=batch)


def _point(phase: str, tokens: int, batch: int, flops: float, parts: tuple[float, float, float],
           hw: Hardware, new_tokens: int) -> PhasePoint:
    weight_bytes, kv_bytes, state_bytes = parts
    nbytes = weight_bytes + kv_bytes + state_bytes
    i = flops / nbytes
    # The roofline time: the math takes at least flops/peak and the traffic at least bytes/bandwidth,
    # and at best they overlap completely.
    time_s = max(flops / hw.peak_flops, nbytes / hw.bandwidth)
    return PhasePoint(phase=phase, tokens=tokens, batch=batch, flops=flops, bytes=nbytes,
                      weight_bytes=weight_bytes, kv_bytes=kv_bytes, state_bytes=state_bytes,
                      intensity=i, bound="compute" if i >= hw.ridge else "memory",
                      attainable_flops=min(hw.peak_flops, i * hw.bandwidth), time_s=time_s,
                      tokens_per_s=new_tokens / time_s)


@dataclass(slots=True, frozen=True)
class Crossover:
    ridge: float                            # the hardware's peak FLOP/s / bandwidth
    prefill_min_prompt_len: int | None      # prefill is compute-bound from this S on; None: never
    prefill_intensity_limit: float          # 2N/k (MoE: 2N'/k; hybrid: F/k), what prefill tends to as S grows
    decode_context: int
    decode_min_batch: int | None            # decode at decode_context is compute-bound from this B on
    decode_intensity_limit: float           # 2N/(kS) (hybrid: F/(kS + 2s)), what decode tends to as B grows


def crossover(m: ModelStats, hw: Hardware, context: int) -> Crossover:
    n, b, k = m.active_params, m.bytes_per_weight, m.kv.bytes_per_token
    f, state = m.flops_per_token, 2 * m.state.bytes_per_sequence
    c = m.kv.bytes_at(context) + state          # what each decoding sequence reads (and writes)
    if m.is_moe or m.is_hybrid:
        # prefill: the state once per sequence, beside the weights; decode: once per sequence and token
        prefill = _first_compute_bound_routed(m, k, hw.ridge, fixed=state)
        decode = _first_compute_bound_routed(m, c, hw.ridge)
    else:
        prefill, decode = first_compute_bound(n, b, k, hw.ridge), first_compute_bound(n, b, c, hw.ridge)
    return Crossover(
        ridge=hw.ridge,
        prefill_min_prompt_len=prefill,
        prefill_intensity_limit=f / k if k else math.inf,
        decode_context=context,
        decode_min_batch=decode,
        decode_intensity_limit=f / c if c else math.inf,
    )


def routed_intensity(m: ModelStats, c: float, x: int, fixed: float = 0.0) -> float:
    """F x / (W(x) + fixed + c x): x tokens of a MoE or hybrid model reading the weights they take once,
    each bringing c bytes of KV (and state), `fixed` bytes beside the weights (a prompt's state).
    F = 2N' for a model without linear attention. (A dense model's W(x) = Nb: intensity(N, b, c, x).)"""
    return m.flops_per_token * x / (m.weight_bytes_read(x) + fixed + c * x)


def _first_compute_bound_routed(m: ModelStats, c: float, ridge: float, fixed: float = 0.0) -> int | None:
    """first_compute_bound where the FLOPs per token are F, not 2N, or the weight bytes grow with x (a
    MoE model): no closed form for the latter, but (W(x) + fixed)/x falls as x grows (W is concave and
    W(0) > 0), so the intensity rises towards F/c and a search finds where it passes the ridge."""
    if m.flops_per_token <= ridge * c:
        return None
    high = 1
    while routed_intensity(m, c, high, fixed) < ridge:
        high *= 2
    low = high // 2         # below the ridge, or 0
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if routed_intensity(m, c, mid, fixed) < ridge else (low, mid)
    return high
