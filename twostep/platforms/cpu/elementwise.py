"""The small per-layer ops as one C++ call each (twostep/kernels/csrc/elementwise.cpp), the CPU's
implementations of the ops "rms_norm", "add_rms_norm" (layers/norm.py), "silu_and_mul"
(layers/activation.py), "rotary" and "rotary_" (layers/rotary.py), for float32 and bf16; and
"first_argmax" (the sampler's greedy pick, sample/argmax.py's answer in one call), for float32.

Rotary is bit-identical to the torch ops (compiled with -ffp-contract=off); RMSNorm sums in
another order and SiLU's exp is a polynomial: within a float32 rounding or two of the torch ops
in float32, one rounding in bf16 (tests/platforms/test_elementwise_kernel.py), and the
token-exactness tests against transformers hold with them."""
from __future__ import annotations

from typing import Callable

import torch


def elementwise_op(kernel, name: str, dtype: torch.dtype) -> Callable | None:
    """The kernel's implementation of op `name` for this dtype, or None (keep the native one)."""
    if kernel is None:
        return None
    if dtype not in (torch.float32, torch.bfloat16) or name not in KERNEL_OPS:
        return None
    if name == "first_argmax" and dtype != torch.float32:     # the sampler's logits are float32
        return None
    return getattr(kernel, name)


KERNEL_OPS = ("rms_norm", "add_rms_norm", "silu_and_mul", "rotary", "rotary_", "first_argmax")
