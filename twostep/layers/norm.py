"""RMSNorm, computed in float32 and cast back, as the reference implementations do. In bf16 it can
run as one C++ call (twostep/kernels/elementwise.cpp) instead of a chain of torch ops; float32 keeps
the torch ops, whose summation order the token-exactness tests against transformers rely on."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.kernel = None            # the elementwise kernel module, used for bf16 inputs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None and x.dtype == self.weight.dtype == torch.bfloat16:
            return self.kernel.rms_norm(x, self.weight, self.eps)
        # Normalise in float32 and cast before the weight multiply: the same rounding point as
        # HF, so bf16 logits agree too. F.rms_norm fuses the reduction (fewer ops per layer).
        normed = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps)
        return self.weight * normed.to(x.dtype)
