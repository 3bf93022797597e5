"""RMSNorm, computed in float32 and cast back, as the reference implementations do. A platform may
supply a fused kernel for the op "rms_norm" (the CPU one, for bf16: platforms/cpu/elementwise.py);
float32 keeps these torch ops, whose summation order the token-exactness tests rely on."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from twostep.layers.custom_op import CustomOp


def rms_norm_native(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalise in float32 and cast before the weight multiply: the same rounding point as
    # HF, so bf16 logits agree too. F.rms_norm fuses the reduction (fewer ops per layer).
    normed = F.rms_norm(x.float(), (x.shape[-1],), None, eps)
    return weight * normed.to(x.dtype)


class RMSNorm(CustomOp):
    op_name = "rms_norm"
    forward_native = staticmethod(rms_norm_native)

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.impl(x, self.weight, self.eps)
