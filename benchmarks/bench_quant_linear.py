"""The linears of one decode step in twostep's packed quantized formats, alone: the matrix-vector
kernel's weight stream against a plain read of the same number of bytes.

    .venv/bin/python benchmarks/bench_quant_linear.py [--formats Q4_0 Q8_0 ...] [--rows 1 4 8] [--reps 9]
                                                     [--activations int16 int8]

All 97 linears of the Qwen2.5-0.5B shape (24 layers x qkv, o, gate_up, down, and the 151,936 x 896
lm_head), random codes and scales in each format's packed layout (quantization/packed.py), each called
once per round with an input of `rows` bf16 rows, as a decode step of that batch would (the weights
and the read's buffer in the memory the engine keeps weights in: 2 MiB pages where the OS gives
them), through the
int16 matrix-vector passes (--cpu-int8-activations off) and the int8 product (the default for a
bf16 model's decode, where the kernel takes the format at that many rows). The products and the
read run interleaved round by round (this machine's bandwidth moves between levels); ms per round,
GB/s of packed weights and the share of the read's rate, medians. Each product's line then gives
the kernel alone: the same round under torch's profiler (also interleaved), the sum of the ops'
spans (twostep::quant_*: from the op's entry to its return, so the activations' quantization, the
threads' fork and join, the product and the output's write, but not the Python call, pybind's and
the dispatcher's hop or FusedLinear's output allocation: what a step's linears cost where the decode
stack calls them from C++, bar that hop and allocation).

Each linear is called as the decode stack calls it (models/fused_decode.py: its FusedLinear, the
kernel's op through the dispatcher from C++, an output allocated a call), where the stack takes that
many rows (else as the layers do, through QuantizedLinearMethod.matmul); --python-layers calls
QuantizedLinearMethod.matmul instead, the general Python path (tens of microseconds a call more on a
slow core: 97 calls of it were ~10% of a Q8_0 round on a Zen 1).
"""
from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from twostep.kernels import decode_step, quant_linear
from twostep.platforms import get_platform
from twostep.platforms.cpu.quant_linear import QuantizedLinearMethod
from twostep.quantization.packed import PackedFormat, QuantizedWeight, pack

SHAPES = [(1152, 896), (896, 896), (9728, 896), (896, 4864)]   # qkv, o, gate_up, down
LAYERS, LM_HEAD = 24, (151936, 896)
# name -> (bits, group, has_min); the K-quants' 16/32-groups need K % 256 == 0 in GGUF, but the
# packed layout does not, so they run on every shape here
FORMATS = {
    "Q4_0": (4, 32, False), "Q4_1": (4, 32, True), "Q5_0": (5, 32, False), "Q8_0": (8, 32, False),
    "Q4_K": (4, 32, True), "Q6_K": (6, 16, False), "int8": (8, 0, False),
}


def random_weight(n: int, k: int, fmt: PackedFormat, rng: np.random.Generator) -> QuantizedWeight:
    if fmt.bits == 8:
        codes = rng.integers(-127, 128, (n, k), dtype=np.int8)
    else:
        codes = rng.integers(0, 1 << fmt.bits, (n, k), dtype=np.uint8)
    groups = k // fmt.group
    scales = rng.uniform(0.001, 0.01, (n, groups)).astype(np.float32)
    mins = -rng.uniform(0.0, 0.05, (n, groups)).astype(np.float32) if fmt.has_min else None
    return QuantizedWeight((pack(codes, scales, mins, fmt),))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", nargs="+", default=["Q4_0", "Q8_0", "Q4_K", "Q6_K"], choices=list(FORMATS))
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--activations", nargs="+", default=["int16", "int8"], choices=["int16", "int8"])
    ap.add_argument("--python-layers", action="store_true",
                    help="call QuantizedLinearMethod.matmul per linear instead of the decode stack's linears")
    args = ap.parse_args()
    kernel, stack = quant_linear(), decode_step()
    if kernel is None or stack is None:
        raise SystemExit("the quantized kernel or the decode stack could not be built here (needs g++ and ninja)")
    methods = {"int16": QuantizedLinearMethod(kernel), "int8": QuantizedLinearMethod(kernel, int8_activations="all")}
    rng = np.random.default_rng(0)
    shapes = [s for _ in range(LAYERS) for s in SHAPES] + [LM_HEAD]
    print(f"{len(shapes)} linears of the Qwen2.5-0.5B shape; kernel path: {kernel.path()}")
    for name in args.formats:
        bits, group, has_min = FORMATS[name]
        # in the layout and the memory the engine binds them in (the panel layout where it fits;
        # a platform's arena a format, freed with it)
        platform = get_platform(torch.device("cpu"))
        method = QuantizedLinearMethod(kernel, arena=platform.arena)
        weights = [method.prepare(random_weight(n, k, PackedFormat(bits, group or k, has_min, name), rng))
                   for n, k in shapes]
        nbytes = sum(w.nbytes for w in weights)
        flat = platform.place_streamed(torch.ones(nbytes // 4))    # a plain read of as many bytes, alike
        print(f"{name}: {nbytes / 1e6:.0f} MB packed ({8 * nbytes / sum(n * k for n, k in shapes):.2f} bits per weight)")
        for rows in args.rows:
            x = {k: torch.randn(rows, k).bfloat16() for k in {k for _, k in shapes}}
            takes = [a for a in args.activations
                     if a == "int16" or (bits in methods[a].int8_bits and methods[a].int8_for(x[896]))]
            paths = {a: round_of_linears(methods[a], weights, x, stack, args.python_layers) for a in takes}
            paths["read"] = flat.sum
            times = {p: [] for p in paths}
            op_times = {p: [] for p in paths if p != "read"}
            for _ in range(args.reps):
                for p, fn in paths.items():
                    start = time.perf_counter()
                    fn()
                    times[p].append(time.perf_counter() - start)
                    if p in op_times:
                        op_times[p].append(op_seconds(fn))
            read_s = statistics.median(times.pop("read"))

            def rate(seconds: list[float]) -> str:
                s = statistics.median(seconds)
                return f"{s * 1e3:6.1f} ms {nbytes / s / 1e9:5.1f} GB/s ({read_s / s:.0%})"

            products = " | ".join(f"{p} {rate(t)}" for p, t in times.items())
            print(f"  rows {rows}: {products} | read {read_s * 1e3:6.1f} ms {nbytes / read_s / 1e9:5.1f} GB/s")
            print("    the ops alone: " + " | ".join(f"{p} {rate(t)}" for p, t in op_times.items()))


def op_seconds(round_fn) -> float:
    """One round under the profiler: the summed spans of its outermost twostep::quant_* ops."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        round_fn()
    spans = [e.cpu_time_total for e in prof.events()
             if e.name.startswith("twostep::quant_")
             and (e.cpu_parent is None or not e.cpu_parent.name.startswith("twostep::quant_"))]
    return sum(spans) / 1e6


def round_of_linears(method: QuantizedLinearMethod, weights: list[QuantizedWeight], x: dict, stack, python: bool):
    """One round of the linears with `method`'s activations: through the decode stack's linears (the
    int8 product where the method takes it at these rows) where the stack would take these rows,
    else (or with python) through matmul."""
    calls = []
    for w in weights:
        linear, limit = method.fused(SimpleNamespace(out_features=w.n, plain_bias=None, quantized=w), stack,
                                     torch.bfloat16)
        stack_takes = not python and (limit is None or x[w.k].shape[0] <= limit)
        calls.append((linear if stack_takes else (lambda xk, w=w: method.matmul(w, xk)), x[w.k]))
    return lambda: [call(xk) for call, xk in calls]


if __name__ == "__main__":
    main()
