"""RMSNorm, computed in float32 and cast back, as the reference implementations do, alone or after
the residual add (vLLM's fused_add_rms_norm: `residual += x; return norm(residual), residual`).
A platform may supply both as one call each (the CPU's: platforms/cpu/elementwise.py)."""
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


def add_rms_norm_native(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                        ) -> torch.Tensor:
    """residual += x in place; the norm of the sum."""
    residual.add_(x)
    return rms_norm_native(residual, weight, eps)


class RMSNorm(CustomOp):
    native_ops = {"rms_norm": rms_norm_native, "add_rms_norm": add_rms_norm_native}

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """norm(x); with a residual, norm(x + residual) and residual updated to the sum in place."""
        if residual is None:
            return self.impls["rms_norm"](x, self.weight, self.eps)
        return self.impls["add_rms_norm"](x, residual, self.weight, self.eps)
