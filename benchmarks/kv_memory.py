"""KV memory of one long sequence on a model with sliding-window layers: what each KV-cache group
holds, measured through the engine's KV manager, against the same sequence with every layer at full
attention (every layer holding every position), and what `twostep analyze` computes for both.

    .venv/bin/python benchmarks/kv_memory.py --model F [--context 8192]

It prefills a random prompt of --context - 1 tokens and decodes two tokens, with prefix caching
off, one sequence, the cache sized from memory for that (so the plan's tensors are what this
sequence could use), and after every step records the blocks each group's table holds (a window
group's blocks are freed as the prompt's chunks pass them; during a step it also holds the chunk's,
which its pool is sized for). Measured bytes: the most blocks each group held after a step, times
its bytes per block.
"""
from __future__ import annotations

import argparse
import random

from twostep import SamplingParams
from twostep.config.engine import EngineConfig
from twostep.engine.llm_engine import LLMEngine


def mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, max_model_len=args.context + 16,
                                    max_num_seqs=1, enable_prefix_caching=False))
    kv, plan, cfg = engine.scheduler.kv, engine.kv_plan, engine.model_config
    prompt = [random.Random(0).randrange(10, cfg.vocab_size) for _ in range(args.context - 1)]
    rid = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    most = [0] * len(kv.groups)
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        most = [max(m, g.num_blocks_of(rid)) for m, g in zip(most, kv.groups)]
        steps += 1
        if steps % 4 == 0:
            print(f"  step {steps}: {engine.scheduler.stats.num_prefill_tokens} prompt tokens", flush=True)
    block = plan.block_size
    measured = sum(m * block * g.bytes_per_token for m, g in zip(most, plan.groups))
    full = kv.blocks_needed(args.context) * block * plan.bytes_per_token
    value_bytes = plan.bytes_per_token // (2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim)
    analyzed = cfg.kv_bytes_at(args.context, value_bytes)
    analyzed_full = args.context * cfg.kv_bytes_per_token(value_bytes)
    print(f"{args.model}: {cfg.num_layers} layers, KV {plan.kv_dtype}, context {args.context}, block {block}")
    for m, g in zip(most, plan.groups):
        span = "full attention" if g.window is None else f"window {g.window}"
        print(f"  {g.num_layers:3d} layers, {span}: at most {m} blocks held after a step "
              f"({mib(m * block * g.bytes_per_token)}); pool {g.num_blocks} blocks "
              f"({mib((g.num_blocks + 1) * block * g.bytes_per_token)})")
    print(f"  measured   {mib(measured)} against {mib(full)} with full attention everywhere: "
          f"{full / measured:.2f}x less")
    print(f"  analyze    {mib(analyzed)} against {mib(analyzed_full)}: {analyzed_full / analyzed:.2f}x less")
    print(f"  the cache's tensors (plan): {mib(plan.total_bytes)}")


if __name__ == "__main__":
    main()
