"""TTFT with and without automatic prefix caching: requests that share a long system prompt.

    .venv/bin/python benchmarks/bench_prefix_caching.py [--model M] [--prefix-len 1024] [--requests 8]

Each request is the same --prefix-len-token system prompt plus a distinct 16-token suffix, sent
one at a time (so TTFT is prefill, not queueing). The first request fills the cache; the
median TTFT of the later ones is compared between an engine with caching and one without,
the two runs interleaved request by request in one process.
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch

from twostep import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--prefix-len", type=int, default=1024)
    ap.add_argument("--suffix-len", type=int, default=16)
    ap.add_argument("--requests", type=int, default=8)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(100, 10000, (args.prefix_len,), generator=g).tolist()
    suffixes = [torch.randint(100, 10000, (args.suffix_len,), generator=g).tolist()
                for _ in range(args.requests)]
    engines = {
        "cached": LLM(args.model, dtype=args.dtype, kv_cache_memory="512MiB"),
        "uncached": LLM(args.model, dtype=args.dtype, kv_cache_memory="512MiB",
                        enable_prefix_caching=False),
    }
    params = SamplingParams(temperature=0, max_tokens=1)
    ttft: dict[str, list[float]] = {k: [] for k in engines}
    cached_tokens: list[int] = []
    for i, suffix in enumerate(suffixes):
        for name, llm in engines.items():
            out = llm.generate([prefix + suffix], params, use_tqdm=False)[0]
            ttft[name].append(out.metrics.ttft)
            if name == "cached":
                cached_tokens.append(out.num_cached_tokens)
    later = slice(1, None)
    med = {k: statistics.median(v[later]) for k, v in ttft.items()}
    print(json.dumps({
        "prompt_tokens": args.prefix_len + args.suffix_len,
        "requests": args.requests,
        "median_ttft_ms_uncached": round(med["uncached"] * 1e3, 1),
        "median_ttft_ms_cached": round(med["cached"] * 1e3, 1),
        "speedup": round(med["uncached"] / med["cached"], 1),
        "first_request_ttft_ms": {k: round(v[0] * 1e3, 1) for k, v in ttft.items()},
        "cached_tokens_per_request": cached_tokens,
        "hit_rate": round(engines["cached"].get_stats()["prefix_cache_hit_rate"], 3),
    }, indent=1))


if __name__ == "__main__":
    main()
