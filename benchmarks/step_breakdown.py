"""Where a decode step's time goes: weights, attention, other model ops, logits and sampling, and
the engine loop (scheduling, step inputs, request updates, output assembly and detokenisation).

    .venv/bin/python benchmarks/step_breakdown.py                    # default model, batch 1
    .venv/bin/python benchmarks/step_breakdown.py --model FILE.gguf --batch 8 --tokens 128
    .venv/bin/python benchmarks/step_breakdown.py --compare-unfused --reps 5   # fused vs torch ops

It runs --batch requests of a 16-token prompt for --tokens decode steps each and times the parts
of every decode step with a clock around them (the clock costs ~0.3 us a call, ~150 calls a step):
  weights    every Linear's forward (the matrix-vector products and their call overhead)
  attention  the attention backend's forward (K/V write and decode attention)
  other ops  the rest of the model forward: embedding, norms, rotary, activation, residual adds
  logits     lm_head on the rows that sample, then the sampler
  engine     everything in LLMEngine.step outside ModelRunner.execute, plus the step's inputs
             and attention metadata
Medians over the decode steps; the bound line is the weights' bytes over --bandwidth (GB/s, e.g.
from `twostep bench ceilings`), when given. --compare-unfused runs the same engine alternately with
the platform's fused per-layer ops and with the PyTorch ops they replace (layers' native_ops, the
K/V write through index_copy_), --reps times each, interleaved: this machine's speed drifts by up to
2x over minutes, so only ratios from one such run mean anything.
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
from twostep.layers.custom_op import CustomOp
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
    """Every Linear's forward timed under "weights" while inside."""
    original = Linear.forward
    clock.wrap(Linear, "forward", "weights")
    try:
        yield
    finally:
        Linear.forward = original


def instrument(llm: LLM, clock: StepClock) -> None:
    engine, runner = llm.engine, llm.engine.runner
    clock.wrap(runner.backend, "forward", "attention")
    clock.wrap(runner.model, "forward", "forward")          # the model's forward alone (no logits)
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
        "other ops": med(lambda s: s["forward"] - s.get("weights", 0) + s.get("lm_head", 0)
                         - s.get("attention", 0)),
        "logits": med(lambda s: s.get("lm_head", 0) + s.get("sampling", 0)),
        "engine": med(lambda s: s["step"] - s["execute"] + s.get("inputs", 0)),
    }
    parts["step"] = med(lambda s: s["step"])
    return parts


class OpSwitch:
    """Switches an engine between the fused per-layer ops it was bound to and PyTorch's."""

    def __init__(self, llm: LLM) -> None:
        self.ops = [m for m in llm.engine.model.modules() if isinstance(m, CustomOp)]
        self.fused = [dict(m.impls) for m in self.ops]
        self.backend = llm.engine.runner.backend
        self.writer = self.backend.write_values

    def use(self, fused: bool) -> None:
        for m, impls in zip(self.ops, self.fused):
            m.impls = dict(impls) if fused else dict(m.native_ops)
        self.backend.write_values = self.writer if fused else None


def measure(llm: LLM, clock: StepClock, prompts, params) -> dict[str, float]:
    clock.steps.clear()
    with clocked_linears(clock):
        llm.generate(prompts, params, use_tqdm=False)
    return breakdown(clock.steps[2:])           # the prefill step and the first decode left out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--compare-unfused", action="store_true", help="also the PyTorch ops, interleaved")
    ap.add_argument("--bandwidth", type=float, default=None, help="GB/s for the weight-stream bound")
    ap.add_argument("--json", action="store_true", help="JSON lines instead of the table")
    args = ap.parse_args()
    llm = LLM(args.model, dtype=args.dtype, max_model_len=args.max_model_len, num_threads=args.num_threads,
              kv_cache_memory="256MiB")
    prompts = [[100 + 7 * i + j for j in range(16)] for i in range(args.batch)]
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    clock, switch = StepClock(), OpSwitch(llm)
    instrument(llm, clock)
    configs = ["fused", "unfused"] if args.compare_unfused else ["fused"]
    runs: dict[str, list[dict[str, float]]] = {c: [] for c in configs}
    for _ in range(args.reps):
        for config in configs:
            switch.use(config == "fused")
            runs[config].append(measure(llm, clock, prompts, params))
    switch.use(True)
    results = {c: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for c, rs in runs.items()}
    weights_mb = weight_bytes(llm.engine.model) / 1e6
    header = {"model": llm.engine.model_path.rsplit("/", 1)[-1], "dtype": str(llm.engine.dtype)[6:],
              "batch": args.batch, "threads": torch.get_num_threads(), "reps": args.reps,
              "weights_MB": round(weights_mb, 1)}
    if args.json:
        for config, parts in results.items():
            print(json.dumps({**header, "ops": config, **{k: round(v, 2) for k, v in parts.items()},
                              "tok_s": round(args.batch * 1e3 / parts["step"], 1)}))
        return
    print(f"{header['model']}, {header['dtype']}, batch {args.batch}, {header['threads']} threads, "
          f"{args.tokens} tokens x {args.reps} reps, {weights_mb:.0f} MB of weights; ms per decode step (share)")
    print("  " + " " * 10 + "".join(f"{c:>18s}" for c in configs))
    for name in ("weights", "attention", "other ops", "logits", "engine", "step"):
        cells = "".join(f"{p[name]:9.2f} ({100 * p[name] / p['step']:4.1f}%)" for p in results.values())
        print(f"  {name:10s}{cells}")
    print("  tokens/s  " + "".join(f"{args.batch * 1e3 / p['step']:18.1f}" for p in results.values()))
    if args.compare_unfused:
        print(f"  fused / unfused speed: {results['unfused']['step'] / results['fused']['step']:.2f}x")
    if args.bandwidth:
        print(f"  weight-stream bound {weights_mb / args.bandwidth:.2f} ms at {args.bandwidth} GB/s")


if __name__ == "__main__":
    main()
