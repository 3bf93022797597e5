"""Decode with the weights in 2 MiB pages (the default, --cpu-huge-pages) against 4 KiB pages.

    .venv/bin/python benchmarks/huge_pages.py [--model M] [--batch 1] [--tokens 64] [--rounds 7]

The same file loaded twice in one process, once each way; the two engines then decode in turns,
round by round (this machine's memory bandwidth moves within minutes, so only an interleaved
ratio says something): ms per decode step (a one-token prompt, `tokens` greedy tokens, EOS
ignored, so prefill is a step of its own), medians, and the ratio. Also checks the two engines
produce the same tokens (the weights are the same bytes, only where they live differs).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from twostep import LLM, SamplingParams
from twostep.models.loader import resolve_model_path

ANON_HUGE = "AnonHugePages:"


def decode_ms(llm: LLM, batch: int, tokens: int) -> tuple[float, list[list[int]]]:
    prompts = [{"prompt_token_ids": [1 + i]} for i in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return (time.perf_counter() - start) * 1e3 / tokens, [o.outputs[0].token_ids for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--num-threads", type=int, default=None)
    args = ap.parse_args()
    path = resolve_model_path(args.model)
    common = dict(kv_cache_memory="256MiB", enable_prefix_caching=False, num_threads=args.num_threads)
    engines = {"2 MiB pages": LLM(path, cpu_huge_pages=True, **common),
               "4 KiB pages": LLM(path, cpu_huge_pages=False, **common)}
    times: dict[str, list[float]] = {name: [] for name in engines}
    tokens = {}
    for name, llm in engines.items():                  # warm-up, and the tokens to compare
        tokens[name] = decode_ms(llm, args.batch, args.tokens)[1]
    for _ in range(args.rounds):
        for name, llm in engines.items():
            times[name].append(decode_ms(llm, args.batch, args.tokens)[0])
    huge, small = (statistics.median(times[n]) for n in engines)
    print(f"{os.path.basename(path)}, batch {args.batch}, {torch.get_num_threads()} threads, "
          f"{args.tokens} tokens x {args.rounds} rounds (ms per decode step, medians)")
    for name in engines:
        print(f"  {name}: {statistics.median(times[name]):6.2f} ms   rounds: "
              + " ".join(f"{t:.2f}" for t in times[name]))
    print(f"  2 MiB / 4 KiB pages: {small / huge:.3f}x; same tokens: {tokens['2 MiB pages'] == tokens['4 KiB pages']}; "
          f"the process's anonymous huge pages: {anon_huge_mib():,.0f} MiB")


def anon_huge_mib() -> float:
    """What the kernel actually gave in 2 MiB pages (madvise is a request)."""
    with open("/proc/self/smaps_rollup") as f:
        line = next((ln for ln in f if ln.startswith(ANON_HUGE)), f"{ANON_HUGE} 0 kB")
    return int(line.split()[1]) / 1024


if __name__ == "__main__":
    main()
