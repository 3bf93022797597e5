"""`twostep bench ceilings`: this machine's limits, measured with the ops the engine uses, and
the roofline bounds they put on a model's two phases.

- memory read bandwidth: a reduction over a tensor far larger than the caches, in the memory
  the weights live in (the bound for decode, which reads every weight once per step);
- matmul FLOP/s per dtype: a large square linear (the bound for prefill);
- the bf16 matrix-vector rate of the engine's own linear path (pre-packed oneDNN on CPU),
  the rate batch-1 decode really gets, on a weight several times the last-level cache.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class Ceilings:
    threads: int
    read_bandwidth_gbs: float          # median GB/s of a sum over a large tensor
    matmul_gflops: dict[str, float]    # dtype -> median GFLOP/s of a large linear
    gemv_bandwidth_gbs: float          # bf16 batch-1 linear through the engine's path, GB/s of weights

    def as_dict(self) -> dict:
        return asdict(self)


def _median_seconds(fn, reps: int) -> float:
    fn()  # warm up
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def read_bandwidth(nbytes: int = 1 << 30, reps: int = 9) -> float:
    """A sum over a tensor in the memory the platform streams weights from (2 MiB pages where the
    OS gives them: a plain read there ran 1.15x one in 4 KiB pages, 67 against 58 GB/s)."""
    from twostep.platforms import get_platform

    x = get_platform(torch.device("cpu")).place_streamed(torch.ones(nbytes // 4, dtype=torch.float32))
    return nbytes / _median_seconds(lambda: x.sum(), reps) / 1e9


def matmul_flops(dtype: torch.dtype, n: int = 2048, reps: int = 5) -> float:
    a = torch.randn(n, n).to(dtype)
    w = torch.randn(n, n).to(dtype)
    return 2 * n**3 / _median_seconds(lambda: F.linear(a, w), reps) / 1e9


def last_level_cache_bytes() -> int:
    """The largest CPU cache's size (sysfs; 32 MiB where it cannot be read)."""
    sizes = {}
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            level = int((index / "level").read_text())
            size = (index / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        sizes[level] = int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size)
    return sizes[max(sizes)] if sizes else 32 << 20


def gemv_bandwidth(rows: int | None = None, cols: int = 8192, reps: int = 5) -> float:
    """bf16 weight [rows, cols] times one row, as the engine computes it: a Linear bound to the
    platform's linear method (oneDNN packed, with the C++ matrix-vector kernel where it builds).
    By default the weight is 8x the last-level cache (256 MiB to 1 GiB): a decode step streams its
    weights once with no reuse, and a smaller matrix called over and over is partly served by the
    cache (64 MiB against a 32 MiB L3 read 41-52 GB/s on a Zen 4 EPYC where 512 MiB read 35, the
    plain read's rate)."""
    from twostep.layers.dispatch import apply_platform
    from twostep.layers.linear import Linear
    from twostep.platforms import get_platform

    if rows is None:
        nbytes = min(max(8 * last_level_cache_bytes(), 256 << 20), 1 << 30)
        rows = nbytes // (2 * cols)
    layer = Linear(cols, rows)
    layer.weight.data = torch.randn(rows, cols).to(torch.bfloat16)
    apply_platform(layer, get_platform(torch.device("cpu")), torch.bfloat16)
    x = torch.randn(1, cols, dtype=torch.bfloat16)
    with torch.inference_mode():
        seconds = _median_seconds(lambda: layer(x), reps)
    return rows * cols * 2 / seconds / 1e9


def measure_ceilings(dtypes: tuple[str, ...] = ("bfloat16", "float32")) -> Ceilings:
    return Ceilings(
        threads=torch.get_num_threads(),
        read_bandwidth_gbs=read_bandwidth(),
        matmul_gflops={d: matmul_flops(getattr(torch, d)) for d in dtypes},
        gemv_bandwidth_gbs=gemv_bandwidth(),
    )


def model_bounds(c: Ceilings, num_params: float, weight_bytes: float, dtype: str) -> dict:
    """Decode batch 1 reads every weight per token; prefill does 2N FLOPs per token."""
    return {
        "decode_batch1_tokens_per_s": c.read_bandwidth_gbs * 1e9 / weight_bytes,
        "decode_batch1_tokens_per_s_at_gemv_rate": c.gemv_bandwidth_gbs * 1e9 / weight_bytes,
        "prefill_tokens_per_s": c.matmul_gflops[dtype] * 1e9 / (2 * num_params),
    }


def format_ceilings(c: Ceilings, bounds: dict | None, model: str | None) -> str:
    lines = [f"this machine, {c.threads} torch threads:",
             f"  memory read bandwidth   {c.read_bandwidth_gbs:8.1f} GB/s",
             f"  bf16 GEMV (engine path) {c.gemv_bandwidth_gbs:8.1f} GB/s of weights"]
    lines += [f"  matmul {d:<16} {g:8.1f} GFLOP/s" for d, g in c.matmul_gflops.items()]
    if bounds:
        lines += [f"bounds for {model}:",
                  f"  decode batch 1   <= {bounds['decode_batch1_tokens_per_s']:8.1f} tokens/s "
                  f"(bandwidth); {bounds['decode_batch1_tokens_per_s_at_gemv_rate']:.1f} at the GEMV rate",
                  f"  prefill          <= {bounds['prefill_tokens_per_s']:8.1f} tokens/s (matmul peak)"]
    return "\n".join(lines)
