"""Predicted vs measured: run the engine on this machine and set its TTFT and TPOT beside the
roofline lower bounds, for prefill and decode separately.

The engine computes in its own dtype (GGUF weights are widened at load), so the prediction
uses that dtype's bytes per weight, not the file's.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch

from twostep.analysis.analyze import Analysis, analyze
from twostep.analysis.hardware import Hardware
from twostep.analysis.roofline import decode_point, prefill_point

_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
DECODE_PROMPT = 16


@dataclass(slots=True, frozen=True)
class Measured:
    phase: str            # "prefill" or "decode"
    tokens: int           # prefill: prompt length; decode: mean context during the measurement
    batch: int
    bound_s: float        # roofline lower bound: TTFT (prefill) or TPOT (decode)
    measured_s: float     # median measured TTFT or TPOT

    @property
    def fraction_of_bound(self) -> float:
        """1.0 would be the hardware limit; 0.25 means four times slower than the bound."""
        return self.bound_s / self.measured_s


def measure(model: str | None, hardware: Hardware, prompt_lengths=(128, 512), batch_sizes=(1, 8),
            decode_tokens: int = 32, reps: int = 3, dtype: str = "auto") -> tuple[Analysis, list[Measured]]:
    from twostep.entrypoints.llm import LLM
    from twostep.models.loader import resolve_model_path

    path = resolve_model_path(model)
    llm = LLM(path, dtype=dtype, enable_prefix_caching=False,
              max_num_batched_tokens=max(2048, *prompt_lengths))
    name = _DTYPE_NAMES[llm.engine.dtype]
    result = analyze(path, hardware=hardware, dtype=name, kv_dtype=name)
    vocab = llm.engine.model_config.vocab_size
    limit = llm.engine.max_model_len
    fitting = [s for s in prompt_lengths if s < limit] or [limit // 2]   # room for the first token
    out = []
    for s in fitting:
        ttft = statistics.median(_ttft(llm, s, vocab, seed) for seed in range(reps))
        out.append(Measured("prefill", s, 1, prefill_point(result.model, hardware, s).time_s, ttft))
    context = DECODE_PROMPT + decode_tokens // 2
    for b in batch_sizes:
        tpot = statistics.median(_tpot(llm, b, decode_tokens, vocab, seed) for seed in range(reps))
        out.append(Measured("decode", context, b,
                            decode_point(result.model, hardware, context, b).time_s, tpot))
    return result, out


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for _ in range(n)]


def _ttft(llm, length: int, vocab: int, seed: int) -> float:
    from twostep.sampling_params import SamplingParams

    out = llm.generate(_prompts(1, length, vocab, seed), SamplingParams(temperature=0, max_tokens=1),
                       use_tqdm=False)[0]
    return out.metrics.ttft


def _tpot(llm, batch: int, tokens: int, vocab: int, seed: int) -> float:
    from twostep.sampling_params import SamplingParams

    outs = llm.generate(_prompts(batch, DECODE_PROMPT, vocab, seed),
                        SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True), use_tqdm=False)
    return statistics.median(o.metrics.tpot for o in outs)


def format_measured(points: list[Measured]) -> str:
    lines = ["predicted (roofline lower bound) vs measured on this machine",
             f"  {'phase':8} {'tokens':>7} {'batch':>6} {'bound':>10} {'measured':>10} {'of bound':>9}"]
    for p in points:
        what = "TTFT" if p.phase == "prefill" else "TPOT"
        lines.append(f"  {p.phase:8} {p.tokens:>7} {p.batch:>6} {p.bound_s * 1e3:>8.2f}ms "
                     f"{p.measured_s * 1e3:>8.2f}ms {p.fraction_of_bound:>8.0%}  ({what})")
    return "\n".join(lines)
