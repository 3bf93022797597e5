"""RMSNorm and rotary embedding as one C++ call each (twostep/kernels/elementwise.cpp), the CPU's
implementations of the ops "rms_norm" and "rotary" (layers/norm.py, layers/rotary.py).

Rotary is bit-identical to the torch ops in float32 and bf16 (compiled with -ffp-contract=off);
RMSNorm is within one bf16 rounding, so it is offered for bf16 only: float32 keeps the torch ops
whose summation order the token-exactness tests against transformers rely on."""
from __future__ import annotations

from typing import Callable

import torch


def elementwise_op(kernel, name: str, dtype: torch.dtype) -> Callable | None:
    """The kernel's implementation of op `name` for this dtype, or None (keep the native one)."""
    if kernel is None:
        return None
    if name == "rms_norm" and dtype == torch.bfloat16:
        return kernel.rms_norm
    if name == "rotary" and dtype in (torch.float32, torch.bfloat16):
        return kernel.rotary
    return None
