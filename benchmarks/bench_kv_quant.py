"""8-bit KV cache vs bfloat16: decode speed at long context and the concurrency that fits.

    .venv/bin/python benchmarks/bench_kv_quant.py [--model M] [--context 4000] [--memory 512MiB]

For each KV format, in one process: blocks in the same --memory budget, how many sequences of
--context tokens fit, and batch-1 decode TPOT with --context tokens in the cache (median over
--reps runs, formats interleaved run by run because this machine's bandwidth drifts).
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch

from twostep import LLM, SamplingParams

FORMATS = ("auto", "int8", "fp8_e4m3")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--context", type=int, default=4000)
    ap.add_argument("--memory", default="512MiB")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    llms = {f: LLM(args.model, kv_cache_memory=args.memory, kv_cache_dtype=f, enable_prefix_caching=False)
            for f in FORMATS}
    vocab = llms["auto"].engine.model_config.vocab_size
    prompt = torch.randint(0, vocab, (args.context,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    tpots: dict[str, list[float]] = {f: [] for f in FORMATS}
    for _ in range(args.reps):
        for f, llm in llms.items():
            tpots[f].append(llm.generate([prompt], params, use_tqdm=False)[0].metrics.tpot)
    rows = []
    for f, llm in llms.items():
        plan = llm.engine.kv_plan
        rows.append({"kv_cache_dtype": plan.kv_dtype, "bytes_per_token": plan.bytes_per_token,
                     "blocks": plan.num_blocks, f"sequences_of_{args.context}": plan.num_tokens // args.context,
                     "decode_tpot_ms": round(statistics.median(tpots[f]) * 1e3, 2),
                     "decode_tok_s": round(1 / statistics.median(tpots[f]), 1)})
    base = rows[0]
    for r in rows:
        r["capacity_vs_base"] = round(r["blocks"] / base["blocks"], 2)
        r["speed_vs_base"] = round(base["decode_tpot_ms"] / r["decode_tpot_ms"], 2)
        print(json.dumps(r))


if __name__ == "__main__":
    main()
