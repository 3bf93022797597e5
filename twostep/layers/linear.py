"""Linear layers with weights pre-packed once for oneDNN (bfloat16 on CPU).

torch's plain bf16 matmul re-reads the weight in its stored layout every call; oneDNN with a
pre-packed (blocked) weight streams it about 1.7x faster for decode-sized inputs (measured in
PERFORMANCE-NOTES.md and benchmarks/). The results are bit-identical to F.linear in bf16, which
the tests check. These are private torch ops, so they are wrapped here only, behind a check
that they exist and work, and everything else keeps nn.Linear.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)


class PackedLinear(nn.Module):
    def __init__(self, packed_weight: torch.Tensor, bias: torch.Tensor | None,
                 in_features: int, out_features: int) -> None:
        super().__init__()
        self.packed_weight = packed_weight
        self.bias = bias
        self.in_features, self.out_features = in_features, out_features

    @staticmethod
    def from_linear(linear: nn.Linear) -> "PackedLinear":
        packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 1)
        bias = None if linear.bias is None else linear.bias.detach()
        return PackedLinear(packed, bias, linear.in_features, linear.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


def can_prepack(dtype: torch.dtype, device: torch.device) -> bool:
    """bf16 on a CPU whose oneDNN computes bf16 natively, and the private ops behave."""
    if device.type != "cpu" or dtype != torch.bfloat16:
        return False
    try:
        if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return False
        w = torch.randn(8, 16).to(dtype)
        x = torch.randn(3, 16).to(dtype)
        return torch.equal(PackedLinear.from_linear(_linear_of(w))(x), F.linear(x, w))
    except (AttributeError, RuntimeError):
        return False


def prepack_linears(model: nn.Module) -> int:
    """Replace every nn.Linear in the model with its packed form; returns how many."""
    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    for name, linear in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, PackedLinear.from_linear(linear))
    return len(targets)


def _linear_of(weight: torch.Tensor) -> nn.Linear:
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype)
    linear.weight.data = weight
    return linear
