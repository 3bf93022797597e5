"""Where a decode step's time goes: weights, attention, other model ops, logits and sampling, and
the engine loop (scheduling, step inputs, request updates, output assembly and detokenisation).

    .venv/bin/python benchmarks/step_breakdown.py                    # default model, batch 1
    .venv/bin/python benchmarks/step_breakdown.py --model FILE.gguf --batch 8 --tokens 128

It runs --batch requests of a 16-token prompt for --tokens decode steps each and times the parts
of every decode step with a clock around them (the clock costs ~0.3 us a call, ~150 calls a step):
  weights    every Linear's forward (the matrix-vector products and their call overhead)
  attention  the attention backend's forward (K/V write and decode attention)
  other ops  the rest of the model forward: embedding, norms, rotary, activation, residual adds
  logits     lm_head on the rows that sample, then the sampler
  engine     everything in LLMEngine.step outside ModelRunner.execute, plus the step's inputs
             and attention metadata
Medians over the decode steps; the bound line is the weights' bytes over --bandwidth (GB/s, e.g.
from `twostep bench ceilings`), when given.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from contextlib import contextmanager

import torch

from twostep import LLM, SamplingParams
from twostep.layers.dispatch import weight_bytes
from twostep.layers.linear import Linear


class StepClock:
    """Seconds spent in each part of the current step; `step` closes it into the history."""

    def __init__(self) -> None:
        self.current: dict[str, float] = defaultdict(float)
        self.steps: list[dict[str, float]] = []

    def wrap(self, owner, name: str, part: str) -> None:
        inner = getattr(owner, name)
        clock = self

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                clock.current[part] += time.perf_counter() - start

        setattr(owner, name, timed)

    def close_step(self, seconds: float) -> None:
        self.current["step"] = seconds
        self.steps.append(dict(self.current))
        self.current.clear()


@contextmanager
def clocked_linears(clock: StepClock):
    original = Linear.forward

    def forward(self, x):
        start = time.perf_counter()
        try:
            return original(self, x)
        finally:
            clock.current["weights"] += time.perf_counter() - start

    Linear.forward = forward
    try:
        yield
    finally:
        Linear.forward = original


def instrument(llm: LLM, clock: StepClock) -> None:
    engine, runner = llm.engine, llm.engine.runner
    clock.wrap(runner.backend, "forward", "attention")
    clock.wrap(runner, "_forward", "forward")
    clock.wrap(runner, "_prepare", "inputs")
    clock.wrap(runner.backend, "build_metadata", "inputs")
    clock.wrap(runner.model, "compute_logits", "lm_head")
    clock.wrap(runner, "_results", "sampling")
    clock.wrap(runner, "execute", "execute")
    step = engine.step

    def timed_step():
        start = time.perf_counter()
        out = step()
        clock.close_step(time.perf_counter() - start)
        return out

    engine.step = timed_step


def breakdown(steps: list[dict[str, float]]) -> dict[str, float]:
    """Median milliseconds per part; lm_head's weights count under logits, not weights."""
    def med(f) -> float:
        return statistics.median(f(s) for s in steps) * 1e3

    parts = {
        "weights": med(lambda s: s.get("weights", 0) - s.get("lm_head", 0)),
        "attention": med(lambda s: s.get("attention", 0)),
        "other ops": med(lambda s: s["forward"] - s.get("inputs", 0) - s.get("weights", 0)
                         + s.get("lm_head", 0) - s.get("attention", 0)),
        "logits": med(lambda s: s.get("lm_head", 0) + s.get("sampling", 0)),
        "engine": med(lambda s: s["step"] - s["execute"] + s.get("inputs", 0)),
    }
    parts["step"] = med(lambda s: s["step"])
    return parts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--bandwidth", type=float, default=None, help="GB/s for the weight-stream bound")
    ap.add_argument("--json", action="store_true", help="one JSON line instead of the table")
    args = ap.parse_args()
    llm = LLM(args.model, dtype=args.dtype, max_model_len=1024, num_threads=args.num_threads)
    prompts = [[100 + 7 * i + j for j in range(16)] for i in range(args.batch)]
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    clock = StepClock()
    instrument(llm, clock)
    with clocked_linears(clock):
        llm.generate(prompts, params, use_tqdm=False)
    decode_steps = clock.steps[2:]          # the prefill step and the first decode left out
    parts = breakdown(decode_steps)
    weights_mb = weight_bytes(llm.engine.model) / 1e6
    result = {"model": llm.engine.model_path.rsplit("/", 1)[-1], "dtype": str(llm.engine.dtype)[6:],
              "batch": args.batch, "threads": torch.get_num_threads(), "steps": len(decode_steps),
              **{k: round(v, 2) for k, v in parts.items()},
              "tok_s": round(args.batch * 1e3 / parts["step"], 1), "weights_MB": round(weights_mb, 1)}
    if args.bandwidth:
        result["bound_ms"] = round(weights_mb / args.bandwidth, 2)
    if args.json:
        print(json.dumps(result))
        return
    print(f"{result['model']}, {result['dtype']}, batch {args.batch}, {result['threads']} threads, "
          f"{len(decode_steps)} decode steps, {weights_mb:.0f} MB of weights")
    for name in ("weights", "attention", "other ops", "logits", "engine", "step"):
        share = 100 * parts[name] / parts["step"]
        print(f"  {name:10s} {parts[name]:7.2f} ms  {share:5.1f}%")
    print(f"  {result['tok_s']} tokens/s" + (f"; weight-stream bound {result['bound_ms']} ms at "
                                             f"{args.bandwidth} GB/s" if args.bandwidth else ""))


if __name__ == "__main__":
    main()
