"""Prefill speed of one model in several files (formats), twostep alone, interleaved: issue 14 asks
that a quantized file prefill no slower than the same weights in bf16.

    .venv/bin/python benchmarks/prefill_formats.py Q/model-bf16.gguf Q/model-Q4_0.gguf ... \
        [--prompt-len 512] [--reps 5] [--threads 2] [--int8-activations all]

Each rep prefills one prompt of --prompt-len random tokens in every file in turn (time to first
token; this machine's bandwidth drifts, so the files alternate) and the medians are printed, with
each file's rate against the first file's.
"""
from __future__ import annotations

import argparse
import statistics

from bench_phases import ours_prefill
from twostep import LLM
from twostep.config.engine import INT8_ACTIVATION_MODES


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", help="model files or folders; the first is the reference")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--int8-activations", default="decode", choices=INT8_ACTIVATION_MODES,
                    help="the engine's --cpu-int8-activations (all: prompts too; a float file is unaffected)")
    args = ap.parse_args()
    llms = [LLM(f, dtype=args.dtype, num_threads=args.threads, enable_prefix_caching=False,
                kv_cache_memory="256MiB", max_model_len=args.prompt_len + 8,
                cpu_int8_activations=args.int8_activations) for f in args.files]
    for llm in llms:
        ours_prefill(llm, 16, seed=0)                                   # warm-up
    rates: list[list[float]] = [[] for _ in llms]
    for rep in range(args.reps):
        for i, llm in enumerate(llms):
            rates[i].append(ours_prefill(llm, args.prompt_len, seed=rep))
        print(f"rep {rep + 1}/{args.reps}: " + ", ".join(f"{r[-1]:.0f}" for r in rates), flush=True)
    first = statistics.median(rates[0])
    print(f"\nprefill {args.prompt_len}, tokens/s, medians of {args.reps}")
    print("| file | tokens/s | against the first |\n|---|---|---|")
    for f, r in zip(args.files, rates):
        print(f"| {f} | {statistics.median(r):.0f} | {statistics.median(r) / first:.2f}x |")


if __name__ == "__main__":
    main()
