"""Tensor parallelism on this machine: TP = 2 (two processes, one core each, gloo) against TP = 1 (one
process, both cores), prefill and decode tokens/s, and the time rank 0 spends in collectives per step.

    .venv/bin/python benchmarks/make_shape.py                 # once: the Qwen2.5-0.5B shape
    .venv/bin/python benchmarks/tensor_parallel.py --model /tmp/twostep-qwen-shape --reps 3

Prefill: one 512-token prompt (TTFT). Decode: batch 1, 64 tokens after a 16-token prompt (TPOT).
The collectives are clocked around TensorParallel.all_reduce and gather_last_dim in rank 0 (the
step's broadcast included), so a step's "collective" time is what rank 0 waits for the other rank
plus the transfer. TP sizes alternate per rep (in turn first); medians are printed. On two cores TP
buys memory per process (each holds half the weights and half the KV heads), not speed.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch.distributed as dist

from twostep import SamplingParams
from twostep.config import EngineConfig
from twostep.distributed import parallel
from twostep.engine.llm_engine import LLMEngine
from twostep.layers.dispatch import weight_bytes


class CollectiveClock:
    """Seconds rank 0 spends in torch.distributed calls while installed."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._originals = {name: getattr(dist, name) for name in ("all_reduce", "all_gather", "broadcast_object_list")}

    def __enter__(self):
        for name, fn in self._originals.items():
            setattr(parallel.dist, name, self._timed(fn))
        return self

    def __exit__(self, *exc):
        for name, fn in self._originals.items():
            setattr(parallel.dist, name, fn)

    def _timed(self, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        return timed


def run_until_done(engine: LLMEngine, prompt: list[int], params: SamplingParams):
    engine.add_request(prompt, params)
    steps, final = 0, None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out
        steps += 1
    return final, steps


def measure(engine: LLMEngine, clock: CollectiveClock) -> dict[str, float]:
    long = [100 + (i * 37) % 5000 for i in range(512)]
    clock.seconds = 0.0
    out, steps = run_until_done(engine, long, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    prefill = {"prefill_tok_s": 512 / out.metrics.ttft, "prefill_collective_ms": 1e3 * clock.seconds / steps}
    engine.reset_prefix_cache()
    clock.seconds = 0.0
    out, steps = run_until_done(engine, long[:16], SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    m = out.metrics
    return prefill | {"decode_tok_s": 1 / m.tpot, "tpot_ms": 1e3 * m.tpot,
                      "decode_collective_ms_per_step": 1e3 * clock.seconds / steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="/tmp/twostep-qwen-shape")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    runs: dict[int, list[dict]] = {1: [], 2: []}
    memory: dict[int, float] = {}
    for rep in range(args.reps):
        for tp in ((1, 2) if rep % 2 == 0 else (2, 1)):
            engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, tensor_parallel_size=tp,
                                            kv_cache_memory="512MiB", max_model_len=2048))
            try:
                memory[tp] = weight_bytes(engine.model) / 2**20
                run_until_done(engine, [5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=4))   # warm up
                with CollectiveClock() as clock:
                    runs[tp].append(measure(engine, clock))
            finally:
                engine.shutdown()
            print(f"rep {rep + 1} TP={tp}: " + ", ".join(f"{k} {v:.2f}" for k, v in runs[tp][-1].items()))
    medians = {tp: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for tp, rs in runs.items()}
    if args.json:
        print(json.dumps({"medians": medians, "weight_mib_per_rank": memory}, indent=2))
        return
    print(f"{'metric':<32} {'TP=1':>10} {'TP=2':>10} {'TP2/TP1':>8}")
    for k in medians[1]:
        a, b = medians[1][k], medians[2][k]
        print(f"{k:<32} {a:>10.2f} {b:>10.2f} {b / a if a else float('nan'):>8.2f}")
    print(f"{'weights held by rank 0 (MiB)':<32} {memory[1]:>10.1f} {memory[2]:>10.1f} {memory[2] / memory[1]:>8.2f}")


if __name__ == "__main__":
    main()
