"""The linears of one decode step, alone: the C++ matrix-vector kernel against oneDNN (pre-packed)
and plain F.linear, and a plain read of the same bytes for the ceiling.

    .venv/bin/python benchmarks/bench_linear.py [--rows 1 2 3 4 8] [--reps 9] [--dtype float32]

--dtype float32: a float32 model's view (CPUs without native bf16): the kernel's float32 inputs
against the bf16 weights (platforms/cpu/bf16_weights.py) and F.linear on the same weights widened
to float32 (twice the bytes); each path's GB/s counts the bytes it reads.

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
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                    help="the activations' dtype (float32: bf16 weights against float32 inputs)")
    args = ap.parse_args()
    kernel = linear_bf16()
    usable = kernel is not None and (kernel.has_bf16_dot() if args.dtype == "bfloat16" else kernel.has_float32_path())
    torch.manual_seed(0)
    weights = [torch.randn(n, k).to(torch.bfloat16) for _ in range(LAYERS) for n, k in SHAPES]
    weights.append(torch.randn(*LM_HEAD).to(torch.bfloat16))
    nbytes = sum(w.numel() * 2 for w in weights)
    flat = torch.ones(nbytes // 2, dtype=torch.bfloat16)
    print(f"{len(weights)} linears, {nbytes / 1e6:.0f} MB of bf16 weights, {args.dtype} inputs; kernel: "
          f"{'built' if usable else 'unavailable here'}")
    if args.dtype == "float32":
        wide = [w.float() for w in weights]
    else:
        packed = [packed_linear(w) for w in weights]
    for rows in args.rows:
        dtype = getattr(torch, args.dtype)
        x = {k: torch.randn(rows, k).to(dtype) for k in {w.shape[1] for w in weights}}
        if args.dtype == "float32":
            paths = {"F.linear float32": (lambda: [F.linear(x[w.shape[1]], w) for w in wide], 2 * nbytes)}
        else:
            paths = {"oneDNN packed": (lambda: [p(x[w.shape[1]]) for p, w in zip(packed, weights)], nbytes),
                     "F.linear": (lambda: [F.linear(x[w.shape[1]], w) for w in weights], nbytes)}
        paths["plain read (sum)"] = (flat.sum, nbytes)
        if usable:
            paths["C++ kernel"] = (lambda: [kernel.linear_bf16(x[w.shape[1]], w, None) for w in weights], nbytes)
        times = {name: [] for name in paths}
        for _ in range(args.reps):
            for name, (fn, _) in paths.items():
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
        for name, t in times.items():
            med = statistics.median(t)
            print(f"rows {rows}: {name:17s} {med * 1e3:6.1f} ms  {paths[name][1] / med / 1e9:5.1f} GB/s")


if __name__ == "__main__":
    main()
