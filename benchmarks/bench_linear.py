"""The linears of one decode step, alone: the C++ matrix-vector kernel against oneDNN (pre-packed)
and plain F.linear, and a plain read of the same bytes for the ceiling.

    .venv/bin/python benchmarks/bench_linear.py [--rows 1 2 3 4 8] [--reps 9]

All 97 linears of the Qwen2.5-0.5B shape (24 layers x qkv, o, gate_up, down, and the 151,936 x 896
lm_head; 988 MB of bf16 weights, random), each called once per round with an input of `rows` rows,
as a decode step of that batch would. The paths run interleaved round by round (this machine's
bandwidth jumps between two levels every few seconds); ms per round and GB/s of weights, medians.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from twostep.kernels import linear_bf16
from twostep.platforms.cpu.linear import packed_linear

SHAPES = [(1152, 896), (896, 896), (9728, 896), (896, 4864)]   # qkv, o, gate_up, down
LAYERS, LM_HEAD = 24, (151936, 896)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 8])
    ap.add_argument("--reps", type=int, default=9)
    args = ap.parse_args()
    kernel = linear_bf16()
    torch.manual_seed(0)
    weights = [torch.randn(n, k).to(torch.bfloat16) for _ in range(LAYERS) for n, k in SHAPES]
    weights.append(torch.randn(*LM_HEAD).to(torch.bfloat16))
    packed = [packed_linear(w) for w in weights]
    nbytes = sum(w.numel() * 2 for w in weights)
    flat = torch.ones(nbytes // 2, dtype=torch.bfloat16)
    print(f"{len(weights)} linears, {nbytes / 1e6:.0f} MB of bf16 weights; kernel: "
          f"{'built' if kernel else 'unavailable (no g++/ninja or no AVX512-BF16)'}")
    for rows in args.rows:
        x = {k: torch.randn(rows, k).to(torch.bfloat16) for k in {w.shape[1] for w in weights}}
        paths = {"oneDNN packed": lambda: [p(x[w.shape[1]]) for p, w in zip(packed, weights)],
                 "F.linear": lambda: [F.linear(x[w.shape[1]], w) for w in weights],
                 "plain read (sum)": flat.sum}
        if kernel is not None:
            paths["C++ kernel"] = lambda: [kernel.linear_bf16(x[w.shape[1]], w, None) for w in weights]
        times = {name: [] for name in paths}
        for _ in range(args.reps):
            for name, fn in paths.items():
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
        for name, t in times.items():
            med = statistics.median(t)
            print(f"rows {rows}: {name:17s} {med * 1e3:6.1f} ms  {nbytes / med / 1e9:5.1f} GB/s")


if __name__ == "__main__":
    main()
