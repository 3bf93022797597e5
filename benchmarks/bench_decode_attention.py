"""Decode attention alone, per layer: the C++ paged kernel against the PyTorch reference backend.

    .venv/bin/python benchmarks/bench_decode_attention.py

Random bf16 cache in SmolLM2's shape (3 KV heads, 3 query heads each, head_dim 64, block 16); for
each (batch, context, queries per sequence) both decode paths run their own plan of the same batch 20 times; ms per
call, medians of 3 rounds.
"""
from __future__ import annotations

import statistics
import time

import torch

from twostep.attention.kv_layer_cache import KVLayerCache
from twostep.attention.metadata import AttentionMetadata
from twostep.attention.options import AttentionOptions
from twostep.attention.paged_decode import PagedDecode
from twostep.attention.reference import ReferenceDecode
from twostep.config import kv_format
from twostep.platforms import get_platform

CASES = [(1, 128, 1), (1, 2000, 1), (8, 128, 1), (8, 1000, 1), (32, 200, 1), (8, 1000, 5)]


def time_ms(fn, n: int = 20) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1e3


def main() -> None:
    kernel = get_platform(torch.device("cpu")).paged_decode_attention(torch.bfloat16, False)
    if kernel is None:
        raise SystemExit("the C++ kernel could not be built here")
    decoders = {"reference": ReferenceDecode(), "cpu_paged": PagedDecode(kernel)}
    kv_heads, group, dim, bs = 3, 3, 64, 16
    for batch, length, nq in CASES:
        blocks = -(-length // bs)
        values = torch.randn(2, batch * blocks + 1, bs, kv_heads, dim).bfloat16()
        cache = KVLayerCache(values, None, kv_format("auto"))
        table = (torch.arange(batch * blocks) + 1).view(batch, blocks)
        starts = [i * nq for i in range(batch + 1)]
        q = torch.randn(batch * nq, kv_heads * group, dim).bfloat16()
        common = AttentionMetadata(starts, [nq] * batch, [length] * batch,
                                   torch.empty(0, dtype=torch.int64), table, bs, [True] * batch)
        out = torch.empty_like(q)
        plans = {name: dec.build(common, list(range(batch))) for name, dec in decoders.items()}
        calls = {name: (lambda dec=dec, plan=plans[name]: dec.forward(q, cache, plan, AttentionOptions(0.125), out))
                 for name, dec in decoders.items()}
        ms = {name: statistics.median(time_ms(fn) for _ in range(3)) for name, fn in calls.items()}
        print(f"batch {batch:>2}, context {length:>5}, queries {nq}: reference {ms['reference']:.3f} ms, "
              f"cpu_paged {ms['cpu_paged']:.3f} ms ({ms['reference'] / ms['cpu_paged']:.2f}x)", flush=True)


if __name__ == "__main__":
    main()
