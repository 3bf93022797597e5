"""A Gated DeltaNet layer's decode step (Qwen3.5, Qwen3-Next) as one C++ call
(twostep/kernels/csrc/gated_delta.cpp): the causal conv1d over the last K inputs, SiLU, q/k
L2-normalised, the gated delta rule on each value head's recurrent state and the gated RMSNorm, the
conv and recurrent states updated in place at each sequence's slot. For float32 and bf16 models;
float32 math that rounds where HF transformers' module rounds (tests/platforms/test_gated_delta_kernel.py)."""
from __future__ import annotations

from collections.abc import Callable

import torch


def gated_delta_decode(kernel, dtype: torch.dtype) -> Callable | None:
    """fn(mixed_qkv [B, C], z [B, Hv*Dv], a [B, Hv], b [B, Hv], conv_state [S, K-1, C],
    recurrent [S, Hv, Dk, Dv] float32, slots int64 [B], conv_weight [C, K], A_log [Hv], dt_bias [Hv],
    norm_weight [Dv], eps, num_k_heads, head_k_dim, head_v_dim) -> [B, Hv*Dv] in the model's dtype,
    or None where the kernel does not build or does not take this dtype."""
    if kernel is None or dtype not in (torch.float32, torch.bfloat16):
        return None
    return kernel.gated_delta_decode
