"""Bind a loaded model's layers to its platform, once: each Linear gets the platform's linear
method for the model's dtype (if it has one), each CustomOp the platform's implementation of its op
(if any). What was switched on is returned for the start-up log."""
from __future__ import annotations

import torch
from torch import nn

from twostep.layers.custom_op import CustomOp
from twostep.layers.linear import Linear
from twostep.platforms import Platform


def apply_platform(model: nn.Module, platform: Platform, dtype: torch.dtype) -> list[str]:
    done = []
    method = platform.linear_method(dtype)
    if method is not None:
        linears = [m for m in model.modules() if isinstance(m, Linear)]
        for linear in linears:
            linear.set_method(method)
        done.append(f"{len(linears)} linears: {method.name}")
        if getattr(method, "keeps_row_major", False):
            done.append(f"1-3 row inputs: C++ matrix-vector kernel; it keeps {_row_major_bytes(model) / 2**20:,.0f} "
                        "MiB of row-major weights beside the packed ones (--no-cpu-gemv to save them)")
    switched = set()
    for m in model.modules():
        if isinstance(m, CustomOp) and m.use(platform.custom_op(m.op_name, dtype)):
            switched.add(m.op_name)
    if switched:
        done.append(f"{' and '.join(sorted(switched))}: {platform.name} kernel")
    return done


def _row_major_bytes(model: nn.Module) -> int:
    """Memory the row-major copies cost on top of the packed weights (a tied lm_head's is the
    embedding table, which exists anyway)."""
    shared = {m.weight.data_ptr() for m in model.modules() if isinstance(m, nn.Embedding)}
    kept = [getattr(m, "row_major_weight", None) for m in model.modules() if isinstance(m, Linear)]
    return sum(w.numel() * w.element_size() for w in kept if w is not None and w.data_ptr() not in shared)
