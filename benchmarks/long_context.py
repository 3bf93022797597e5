"""Decode time per token at a short and a long context, and what one sequence holds, for each model
given: a hybrid (Qwen3.5: three of four layers keep a constant state) beside a full-attention model
of about the same size (Qwen3-0.6B's shape).

    .venv/bin/python benchmarks/long_context.py --model /tmp/twostep-qwen35-shape/model-Q4_0.gguf \\
        --model /tmp/twostep-qwen3-shape/model-Q4_0.gguf [--contexts 256 8192] [--tokens 32]

For each model and context: one sequence, prefix caching off, a random prompt of context - 1
tokens prefilled, then --tokens greedy tokens; TPOT is the median gap between consecutive tokens
(batch 1, 2 threads unless --threads). Memory per sequence: its K/V at that context (attention
layers only: the plan's bytes per token times the context) plus its state (the hybrid's state slot:
conv and recurrent states of every linear-attention layer), both from the engine's own plan.
Prints a markdown table.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

from twostep import SamplingParams
from twostep.config.engine import EngineConfig
from twostep.engine.llm_engine import LLMEngine


def measure(model: str, context: int, tokens: int, threads: int) -> tuple[float, int, int]:
    """(median seconds per decoded token, K/V bytes of the sequence, its state bytes)."""
    engine = LLMEngine(EngineConfig(model=model, max_model_len=context + tokens + 16, max_num_seqs=1,
                                    enable_prefix_caching=False, num_threads=threads))
    cfg = engine.model_config
    prompt = [random.Random(0).randrange(10, cfg.vocab_size - 10) for _ in range(context - 1)]
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
    stamps = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.outputs[0].token_ids:
                stamps.append(time.perf_counter())
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    kv = engine.kv_plan.bytes_per_token * context
    state = cfg.state_bytes(engine.dtype.itemsize) if cfg.linear_layers else 0
    return statistics.median(gaps), kv, state


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", action="append", required=True)
    ap.add_argument("--contexts", type=int, nargs="+", default=[256, 8192])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    print("| model | context | TPOT ms | tokens/s | K/V MiB | state MiB | per sequence MiB |")
    print("|---|---|---|---|---|---|---|")
    for model in args.model:
        for context in args.contexts:
            tpot, kv, state = measure(model, context, args.tokens, args.threads)
            print(f"| {model} | {context} | {tpot * 1e3:.1f} | {1 / tpot:.1f} | {kv / 2**20:.1f} | "
                  f"{state / 2**20:.1f} | {(kv + state) / 2**20:.1f} |", flush=True)


if __name__ == "__main__":
    main()
