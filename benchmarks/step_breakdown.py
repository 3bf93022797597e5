"""Where a decode step's time goes: weights, attention, other model ops, logits and sampling, and
the step's inputs, and the engine loop (scheduling, request updates, output assembly and
detokenisation).

    .venv/bin/python benchmarks/step_breakdown.py                    # default model, batch 1
    .venv/bin/python benchmarks/step_breakdown.py --model FILE.gguf --batch 8 --tokens 128
    .venv/bin/python benchmarks/step_breakdown.py --compare-unfused --reps 5   # fused vs torch ops

It runs --batch requests of a 16-token prompt for --tokens decode steps each and times the parts
of every decode step with a clock around them (the clock costs ~0.3 us a call, ~150 calls a step):
  weights    every Linear's forward (the matrix-vector products and their call overhead)
  attention  the attention backend's forward (K/V write and decode attention)
  other ops  the rest of the model forward: embedding, norms, rotary, activation, residual adds
  logits     lm_head on the rows that sample, then the sampler
  inputs     the step's input tensors (ModelRunner._prepare) and the attention metadata
  engine     the engine loop: everything in LLMEngine.step outside ModelRunner.execute
             (scheduling, request updates, output assembly and detokenisation)
When the decode stack runs the layers in one C++ call (models/fused_decode.py; "stack" below), no
Python clock sees inside it: a profile of a few more steps (at the measured steps' mean context)
gives the time of its matrix-vector ops
(under weights), of its K/V writes and paged attention (under attention) and of the lm_head it runs where a
step wants every row's logits (under logits), per call; the rest of
its clocked time, the stack's glue, stays under other ops.
Medians over the decode steps; the bound line is the bytes a batch-1 step streams (each linear's
form the matrix-vector product reads: quantized codes, or the row-major bf16 copy; the lm_head
included) over --bandwidth (GB/s, e.g. from `twostep bench ceilings`), when given. --gemv-bound
measures that rate itself, `bench ceilings`' bf16 GEMV, before and after every rep, and prints each
rep's step against the bound at the mean of the two rates around it: the machine's speed moves
within seconds, so a bound measured in another minute says little. --compare-unfused runs the same
engine alternately in three ways: the decode stack ("stack"), the Python layers on the platform's per-layer C++ ops
("layers"), and the PyTorch ops those replace ("torch ops": layers' native_ops, the K/V write
through index_copy_), --reps times each, interleaved: this machine's speed drifts by up to 2x over
minutes, so only ratios from one such run mean anything.
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
from twostep.analysis.ceilings import gemv_bandwidth
from twostep.layers.custom_op import CustomOp
from twostep.layers.dispatch import streamed_weight_bytes, weight_bytes
from twostep.config.engine import INT8_ACTIVATION_MODES
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
    # the model's forward (and, where the decode stack runs the lm_head, the logits: split_stack)
    clock.wrap(runner.model, "hidden_and_logits", "forward")
    if runner.model.fused_decode is not None:
        clock.wrap(runner.model, "fused_decode", "stack")   # the decode stack: one C++ call
    clock.wrap(runner, "_prepare", "inputs")
    clock.wrap(runner.backend, "build_metadata", "inputs")
    clock.wrap(runner.model, "compute_logits", "lm_head")   # the logits where the stack does not run them
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
        "inputs": med(lambda s: s.get("inputs", 0)),
        "engine": med(lambda s: s["step"] - s["execute"]),
    }
    parts["stack"] = med(lambda s: s.get("stack", 0))
    parts["step"] = med(lambda s: s["step"])
    return parts


WEIGHT_OPS = ("twostep::quant_gemv", "twostep::quant_gemm_int8", "twostep::linear_bf16", "aten::linear")
ATTENTION_OPS = ("twostep::paged_decode_attention", "twostep::write_kv")
STACK = "twostep::decode_layers"
HEAD = "twostep::decode_head"           # inside STACK: its lm_head


class OpSwitch:
    """Switches an engine between the ways it can run a decode step: "stack" (as bound: the decode
    stack where it applies), "layers" (the Python layers on the platform's per-layer ops) and
    "torch ops" (the PyTorch ops those replace)."""

    def __init__(self, llm: LLM) -> None:
        self.model = llm.engine.model
        self.stack = self.model.fused_decode
        self.ops = [m for m in self.model.modules() if isinstance(m, CustomOp)]
        self.fused = [dict(m.impls) for m in self.ops]
        self.backend = llm.engine.runner.backend
        self.writer = self.backend.write_values

    def use(self, config: str) -> None:
        self.model.fused_decode = self.stack if config == "stack" else None
        for m, impls in zip(self.ops, self.fused):
            m.impls = dict(m.native_ops) if config == "torch ops" else dict(impls)
        self.backend.write_values = None if config == "torch ops" else self.writer


def measure(llm: LLM, clock: StepClock, prompts, params, in_stack: bool) -> dict[str, float]:
    clock.steps.clear()
    with clocked_linears(clock):
        llm.generate(prompts, params, use_tqdm=False)
    parts = breakdown(clock.steps[2:])          # the prefill step and the first decode left out
    layers = parts.pop("stack")
    if in_stack:
        mean_context = len(prompts[0]) + params.max_tokens // 2
        split_stack(parts, layers, stack_kernels(llm, prompts, mean_context))
    return parts


def stack_kernels(llm: LLM, prompts, context: int) -> tuple[float, float, float]:
    """Milliseconds a decode stack call spends in the layers' matrix-vector ops, in the attention ops
    and in its head (the lm_head and the logits' float32 copy),
    from a profile of a few decode steps (each op's own time; the profiler's cost per event falls
    on the stack's glue between them, so these two are the less distorted part) at about `context`
    positions, the measured steps' mean: the prompts lengthened to it (attention's time grows with
    the context; profiled at the prompt's length, a 1000-token run put most of it under other ops)."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    at_context = [p + [100 + (p[-1] + j) % 1000 for j in range(1, context - len(p) + 1)] for p in prompts]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        llm.generate(at_context, params, use_tqdm=False)
    calls, total = 0, {"weights": 0.0, "attention": 0.0, "head": 0.0}
    for event in prof.events():
        if event.name == STACK:
            calls += 1
        elif event.name == HEAD and _under(event, STACK):
            total["head"] += event.cpu_time_total / 1e3
        elif _under(event, STACK) and not _under(event, HEAD):
            kind = "weights" if event.name in WEIGHT_OPS else "attention" if event.name in ATTENTION_OPS else None
            if kind is not None and not _under(event, (*WEIGHT_OPS, *ATTENTION_OPS)):
                total[kind] += event.cpu_time_total / 1e3
    return tuple(total[k] / calls for k in ("weights", "attention", "head")) if calls else (0.0, 0.0, 0.0)


def _under(event, names) -> bool:
    names = (names,) if isinstance(names, str) else names
    parent = event.cpu_parent
    while parent is not None:
        if parent.name in names:
            return True
        parent = parent.cpu_parent
    return False


def split_stack(parts: dict[str, float], layers: float, kernels: tuple[float, float, float]) -> None:
    """Move the stack's weights and attention out of "other ops", where the clock put them, and its
    head into logits (at most the stack's clocked time)."""
    weights, attention, head = (min(k, layers) for k in kernels)
    attention = min(attention, layers - weights)
    head = min(head, layers - weights - attention)
    parts["weights"] += weights
    parts["attention"] += attention
    parts["logits"] += head
    parts["other ops"] -= weights + attention + head


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--compare-unfused", action="store_true",
                    help="also the Python layers and the PyTorch ops, interleaved")
    ap.add_argument("--bandwidth", type=float, default=None, help="GB/s for the weight-stream bound")
    ap.add_argument("--gemv-bound", action="store_true",
                    help="measure the bf16 GEMV rate (bench ceilings') around each rep: the step against it")
    ap.add_argument("--json", action="store_true", help="JSON lines instead of the table")
    ap.add_argument("--int8-activations", nargs="?", const="all", default="decode", choices=INT8_ACTIVATION_MODES,
                    help="the engine's --cpu-int8-activations (default: decode, the engine's)")
    ap.add_argument("--prompt-len", type=int, default=16, help="tokens of each sequence's prompt")
    args = ap.parse_args()
    llm = LLM(args.model, dtype=args.dtype, max_model_len=args.max_model_len, num_threads=args.num_threads,
              kv_cache_memory="256MiB", cpu_int8_activations=args.int8_activations)
    prompts = [[100 + 7 * i + j for j in range(args.prompt_len)] for i in range(args.batch)]
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    clock = StepClock()
    instrument(llm, clock)
    switch = OpSwitch(llm)
    first = "stack" if switch.stack is not None else "layers"
    configs = [first, *(c for c in ("layers", "torch ops") if c != first)] if args.compare_unfused else [first]
    runs: dict[str, list[dict[str, float]]] = {c: [] for c in configs}
    rates: list[float] = []
    for _ in range(args.reps):
        if args.gemv_bound:
            rates.append(gemv_bandwidth())
        for config in configs:
            switch.use(config)
            runs[config].append(measure(llm, clock, prompts, params, config == "stack"))
    if args.gemv_bound:
        rates.append(gemv_bandwidth())
        rates = [(before + after) / 2 for before, after in zip(rates, rates[1:])]
    switch.use(first)
    results = {c: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for c, rs in runs.items()}
    weights_mb = weight_bytes(llm.engine.model) / 1e6
    stream_mb = streamed_weight_bytes(llm.engine.model) / 1e6
    header = {"model": llm.engine.model_path.rsplit("/", 1)[-1], "dtype": str(llm.engine.dtype)[6:],
              "batch": args.batch, "threads": torch.get_num_threads(), "reps": args.reps,
              "weights_MB": round(weights_mb, 1)}
    shares = [stream_mb / rate / run["step"] for rate, run in zip(rates, runs[first])]
    if args.json:
        for config, parts in results.items():
            bound = {"stream_MB": round(stream_mb, 1), "gemv_GBs": [round(r, 1) for r in rates],
                     "gemv_bound_share": [round(x, 3) for x in shares]} if rates and config == first else {}
            print(json.dumps({**header, "ops": config, **{k: round(v, 2) for k, v in parts.items()},
                              "tok_s": round(args.batch * 1e3 / parts["step"], 1), **bound}))
        return
    print(f"{header['model']}, {header['dtype']}, batch {args.batch}, {header['threads']} threads, "
          f"{args.tokens} tokens x {args.reps} reps, {weights_mb:.0f} MB of weights; ms per decode step (share)")
    print("  " + " " * 10 + "".join(f"{c:>18s}" for c in configs))
    for name in ("weights", "attention", "other ops", "logits", "inputs", "engine", "step"):
        cells = "".join(f"{p[name]:9.2f} ({100 * p[name] / p['step']:4.1f}%)" for p in results.values())
        print(f"  {name:10s}{cells}")
    print("  tokens/s  " + "".join(f"{args.batch * 1e3 / p['step']:18.1f}" for p in results.values()))
    if args.compare_unfused:
        print("  speed against the torch ops: " + ", ".join(
            f"{c} {results['torch ops']['step'] / results[c]['step']:.2f}x" for c in configs))
    if args.bandwidth:
        print(f"  weight-stream bound {stream_mb / args.bandwidth:.2f} ms ({stream_mb:.0f} MB a step at "
              f"{args.bandwidth} GB/s)")
    if rates:
        print(f"  {stream_mb:.0f} MB a step; per rep, the bf16 GEMV rate measured around it and the "
              f"step's share of the bound at that rate (median {statistics.median(shares):.0%}):")
        for rate, run, share in zip(rates, runs[first], shares):
            print(f"    {rate:5.1f} GB/s: bound {stream_mb / rate:6.2f} ms, step {run['step']:6.2f} ms = {share:.0%}")


if __name__ == "__main__":
    main()
