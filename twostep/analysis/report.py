"""The analysis as a short plain-text report, or as JSON for tools."""
from __future__ import annotations

import dataclasses
import json

from twostep.analysis.analyze import Analysis
from twostep.analysis.model_stats import DELTA_RULE_FLOPS, ModelStats
from twostep.analysis.roofline import Crossover, PhasePoint, decode_point

# decode at these two contexts, batch 1, side by side for a hybrid model: its state's bytes are flat
CONTEXT_COMPARISON = (256, 8192)


def to_json(a: Analysis) -> str:
    data = dataclasses.asdict(a)
    data["hardware"]["ridge"] = a.hardware.ridge    # a property, which asdict leaves out
    return json.dumps(data, indent=2)


def format_report(a: Analysis) -> str:
    hw, c = a.hardware, a.crossover
    m = a.model
    lines = _model_lines(m)
    lines.append(f"{hw.name}: {_rate(hw.peak_flops, 'FLOP/s')}, {_rate(hw.bandwidth, 'B/s')}, "
                 f"{_size(hw.memory)}; ridge {hw.ridge:.1f} FLOP/byte")
    prefill, decode = _formulas(m)
    lines += ["", f"prefill, 1 sequence of S tokens: intensity {prefill}"]
    lines += _phase_table("S", a.prefill, "TTFT >=", lambda p: p.tokens, m)
    lines.append(_prefill_flip(c, m))
    lines += ["", f"decode, B sequences at context S={c.decode_context:,}: intensity {decode}"]
    lines += _phase_table("B", a.decode, "TPOT >=", lambda p: p.batch, m)
    lines.append(_decode_flip(c, m))
    lines += _context_lines(a)
    lines += [""] + _memory_lines(a)
    return "\n".join(lines)


def _formulas(m: ModelStats) -> tuple[str, str]:
    """The intensity of each phase as roofline.py computes it: N' active and W(x) the weights x tokens'
    experts read for a MoE model; F FLOPs per token and s state bytes per sequence for a hybrid."""
    n2, w_s, w_b = ("2N'", "W(S)", "W(B)") if m.is_moe else ("2N", "Nb", "Nb")
    if m.is_hybrid:
        return f"FS/({w_s}+kS+2s)", f"FB/({w_b}+(kS+2s)B)"
    return f"{n2}S/({w_s}+kS)", f"{n2}B/({w_b}+kSB)"


def _model_lines(m: ModelStats) -> list[str]:
    p = m.params
    head = "tied to the embedding" if p.tied else "untied"
    given = "" if m.num_params == p.total else f" (given; {_count(p.total)} counted)"
    return [
        f"{m.name}: {m.architecture}, {m.num_layers} layers, hidden {m.hidden_size}, "
        f"{m.num_heads} query / {m.num_kv_heads} KV heads x {m.head_dim}",
        f"  N = {_count(m.num_params)} parameters{given}",
        f"      layers {_count(p.layers)}, embedding {_count(p.embedding)}, "
        f"lm_head {_count(p.lm_head)} ({head}), final norm {p.final_norm}",
    ] + _moe_lines(m) + [
        f"  b = {m.bytes_per_weight:.4g} bytes/weight ({m.weight_format}): "
        f"weights {_size(m.weight_bytes)}" + (
            f" resident, {_size(m.active_weight_bytes)} read per token at batch 1" if m.is_moe else ""),
    ] + _kv_lines(m) + _window_lines(m) + _state_lines(m)


def _kv_lines(m: ModelStats) -> list[str]:
    kv = m.kv
    formula = (f"2 x {kv.layers} layers x {m.num_kv_heads} KV heads x ({m.head_dim} x {kv.bytes_per_value} B"
               f"{' + 2 B scale' if kv.bytes_per_value == 1 else ''}) ({kv.format})")
    if m.is_hybrid:
        first = (f"  K/V for {kv.layers} of {m.num_layers} layers (the attention ones): "
                 f"k = {kv.bytes_per_token:,} bytes/token = {formula}")
    else:
        first = f"  k = {kv.bytes_per_token:,} bytes/token = {formula}"
    return [first, f"      {kv.attention}: MHA would need {kv.mha_bytes_per_token:,}, {kv.saving:.1f}x as much"]


def _state_lines(m: ModelStats) -> list[str]:
    """A hybrid's linear-attention state and the delta rule's FLOPs (model_stats.StateStats)."""
    st = m.state
    if not m.is_hybrid:
        return []
    n = "N'" if m.is_moe else "N"
    return [f"  linear-attention state: {_mib(st.bytes_per_sequence)} per sequence, constant in the context: "
            f"s = {st.bytes_per_sequence:,} bytes",
            f"      = {st.layers} layers x (conv {st.conv_kernel - 1} x {st.conv_dim} x {st.conv_value_bytes} B "
            f"+ recurrent {st.value_heads} heads x {st.key_head_dim} x {st.value_head_dim} x "
            f"{st.recurrent_value_bytes} B), read and written once per decoded token",
            f"  F = 2{n} + the delta rule's {_count(st.flops_per_token)} = {_count(m.flops_per_token)} FLOPs per token",
            f"      delta rule: {st.layers} layers x {st.value_heads} heads x {DELTA_RULE_FLOPS} x {st.key_head_dim} x "
            f"{st.value_head_dim} (its recurrence), the same at any context: no attention scores"]


def _moe_lines(m: ModelStats) -> list[str]:
    """Total and active parameters: memory holds every expert, a token runs through k of them."""
    p = m.params
    if not p.is_moe:
        return []
    scale = m.num_params / p.total
    return [f"  parameters: {_billions(m.num_params)} total, {_billions(m.active_params)} active per token "
            f"({p.experts_per_tok} of {p.num_experts} experts)",
            f"      N' = {_count(m.active_params)} active, 2N' FLOPs per token; experts "
            f"{_count(p.experts * scale)} ({p.num_experts} x {_count(p.expert * scale)} x {p.moe_layers} layers)"]


def _window_lines(m: ModelStats, context: int = 8192) -> list[str]:
    kv = m.kv
    if not kv.windowed:
        return []
    windowed = [w for w in kv.windows if w]
    full, held = kv.bytes_per_token * context, kv.bytes_at(context)
    return [f"      sliding window {max(windowed):,} in {len(windowed)} of {m.num_layers} layers: a sequence of "
            f"{context:,} tokens holds {_size(held)} of K/V, against {_size(full)} with full attention "
            f"everywhere ({full / held:.1f}x)"]


def _context_lines(a: Analysis) -> list[str]:
    """Decode at batch 1 at a short and a long context: a hybrid's state bytes stay, its K/V grow."""
    m = a.model
    if not m.is_hybrid:
        return []
    points = [decode_point(m, a.hardware, s, 1) for s in CONTEXT_COMPARISON]
    rows = [["context S"] + [f"{p.tokens:,}" for p in points],
            ["weights read"] + [_size(p.weight_bytes) for p in points],
            ["K/V read"] + [_size(p.kv_bytes) for p in points],
            ["state read+written"] + [_size(p.state_bytes) for p in points],
            ["TPOT >="] + [_time(p.time_s) for p in points]]
    short, long = points
    growth = long.time_s / short.time_s - 1
    return (["", f"decode, batch 1, at context {short.tokens:,} against {long.tokens:,}: the state is the same, "
                 f"the K/V grow with S"] + _table(rows) +
            [f"  TPOT {'+' if growth >= 0 else ''}{growth:.1%} from {short.tokens:,} to {long.tokens:,}; the state's "
             f"{_size(short.state_bytes)} per token is flat, the K/V's {_size(short.kv_bytes)} -> "
             f"{_size(long.kv_bytes)}"])


def _phase_table(key: str, points: tuple[PhasePoint, ...], time_label: str, size, m: ModelStats) -> list[str]:
    rows = [
        [key] + [f"{size(p):,}" for p in points],
        ["FLOP/byte"] + [_intensity(p.intensity) for p in points],
        ["bound"] + [p.bound for p in points],
        [time_label] + [_time(p.time_s) for p in points],
        ["tokens/s <="] + [f"{p.tokens_per_s:,.0f}" for p in points],
    ]
    if m.is_moe:    # W(x): the weights of the experts these tokens take, expected
        rows.insert(1, ["weights read"] + [_size(m.weight_bytes_read(size(p))) for p in points])
    return _table(rows)


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  " + row[0].ljust(widths[0]) + "".join(cell.rjust(w + 2) for cell, w in
                                                     zip(row[1:], widths[1:])) for row in rows]


def _prefill_flip(c: Crossover, m: ModelStats) -> str:
    if c.prefill_min_prompt_len is None:
        return (f"  never compute-bound: intensity tends to {_flops_name(m)}/k = {c.prefill_intensity_limit:.1f} "
                f"< ridge {c.ridge:.1f}")
    return f"  compute-bound from S >= {c.prefill_min_prompt_len:,} tokens"


def _decode_flip(c: Crossover, m: ModelStats) -> str:
    if c.decode_min_batch is None:
        per_sequence = "(kS+2s)" if m.is_hybrid else "(kS)"
        return (f"  never compute-bound at this context: intensity tends to {_flops_name(m)}/{per_sequence} = "
                f"{c.decode_intensity_limit:.1f} < ridge {c.ridge:.1f} as B grows")
    return f"  compute-bound from B >= {c.decode_min_batch:,} sequences"


def _flops_name(m: ModelStats) -> str:
    """FLOPs per token as the formulas name them: 2N, 2N' (MoE) or F (hybrid)."""
    return "F" if m.is_hybrid else "2N'" if m.is_moe else "2N"


def _memory_lines(a: Analysis) -> list[str]:
    mem, m = a.memory, a.model
    need = mem.weight_bytes + mem.kv_bytes + mem.state_bytes
    weights = " (every expert)" if m.is_moe else ""
    if m.is_hybrid:
        lines = [f"memory {_size_gib(mem.budget)}, weights, KV and linear-attention state only "
                 "(activations come on top)",
                 f"  KV cache for {mem.concurrency:,} x {mem.context:,} tokens: {_size_gib(mem.kv_bytes)}; "
                 f"linear-attention state for {mem.concurrency:,} sequence(s): {_size_gib(mem.state_bytes)}",
                 f"      with the weights{weights} {_size(need)}: {'fits' if mem.fits else 'does not fit'}"]
    else:
        lines = [f"memory {_size_gib(mem.budget)}, weights and KV only (activations come on top)",
                 f"  KV cache for {mem.concurrency:,} x {mem.context:,} tokens: {_size_gib(mem.kv_bytes)}; "
                 f"with the weights{weights} {_size(need)}: {'fits' if mem.fits else 'does not fit'}"]
    if mem.kv_budget <= 0:
        lines.append(f"  the weights alone exceed the memory by {_size(-mem.kv_budget)}")
        return lines
    if m.is_hybrid:
        lines.append(f"  {_size(mem.kv_budget)} left for KV and state: beside {mem.concurrency:,} state(s), "
                     f"{mem.max_tokens:,} tokens of KV: {mem.concurrency:,} sequence(s) of up to {mem.max_context:,}")
    else:
        lines.append(f"  {_size(mem.kv_budget)} left for KV holds {mem.max_tokens:,} tokens: "
                     f"{mem.concurrency:,} sequence(s) of up to {mem.max_context:,}")
    lines.append(f"      (the model's limit is {mem.model_max_context:,}), or "
                 f"{mem.max_concurrency:,} sequences of {mem.context:,}")
    return lines


def _intensity(x: float) -> str:
    # As the reference text rounds: ~1.00 for decode, ~1020.1 for prefill.
    return f"{x:.2f}" if x < 10 else f"{x:,.1f}" if x < 1e5 else f"{x:,.0f}"


def _count(n: float) -> str:
    return f"{n:.4g}" if n < 1e4 else f"{n:.4e}".replace("e+0", "e").replace("e+", "e")


def _billions(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M" if n >= 1e5 else f"{n:,.0f}"


def _scaled(value: float, units: tuple[str, ...]) -> tuple[float, str]:
    """Decimal prefixes, as datasheets use: 80 GB, 3.35 TB/s."""
    i = 0
    while value >= 1000 and i < len(units) - 1:
        value, i = value / 1000, i + 1
    return value, units[i]


def _size(nbytes: float) -> str:
    value, unit = _scaled(nbytes, ("B", "kB", "MB", "GB", "TB"))
    return f"{value:.4g} {unit}"


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.2f} MiB"


def _size_gib(nbytes: float) -> str:
    return f"{_size(nbytes)} ({nbytes / 2**30:.2f} GiB)"


def _rate(per_s: float, unit: str) -> str:
    value, prefix = _scaled(per_s, ("", "k", "M", "G", "T", "P"))
    return f"{value:.4g} {prefix}{unit}"


def _time(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.3g} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e6:.3g} us"
