"""Linear layers with weights pre-packed once for oneDNN (bfloat16 on CPU), and a C++
matrix-vector kernel for inputs of one to three rows.

torch's plain bf16 matmul re-reads the weight in its stored layout every call; oneDNN with a
pre-packed (blocked) weight runs 1.1x (prefill) to 1.7x (a few rows) faster (benchmarks/
bench_linear.py). Its results are bit-identical to F.linear in bf16, which the tests check. These
are private torch ops, so they are wrapped here only, behind a check that they exist and work,
and everything else keeps nn.Linear.

Batch-1 decode is one matrix-vector product per linear: there twostep/kernels/linear_bf16.cpp
streams the row-major weight at ~1.3x oneDNN's packed GEMV (93% of a plain read of the same bytes);
the two are even at 4 rows and oneDNN wins from there (benchmarks/bench_linear.py). The kernel
reads the weight as stored, so a layer that uses it keeps the row-major weight beside the packed
one (a tied lm_head's is the embedding table, already in memory). It accumulates in float32 in
another order than oneDNN: within bf16 rounding, not bit-identical.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)


GEMV_MAX_ROWS = 3   # inputs with at most this many rows take the matrix-vector kernel (measured)


class PackedLinear(nn.Module):
    def __init__(self, packed_weight: torch.Tensor, bias: torch.Tensor | None,
                 in_features: int, out_features: int,
                 weight: torch.Tensor | None = None, gemv=None) -> None:
        super().__init__()
        self.packed_weight = packed_weight
        self.bias = bias
        self.in_features, self.out_features = in_features, out_features
        self.weight, self.gemv = weight, gemv       # row-major weight and kernel, or None, None

    @staticmethod
    def from_linear(linear: nn.Linear, gemv=None) -> "PackedLinear":
        """gemv: the linear_bf16 kernel module, to keep the row-major weight for 1-3 row inputs."""
        weight = linear.weight.detach()
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
        bias = None if linear.bias is None else linear.bias.detach()
        return PackedLinear(packed, bias, linear.in_features, linear.out_features,
                            None if gemv is None else weight.contiguous(), gemv)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemv is not None and x.numel() <= GEMV_MAX_ROWS * self.in_features:
            return self.gemv.linear_bf16(x, self.weight, self.bias)
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


def prepack_linears(model: nn.Module, gemv=None) -> int:
    """Replace every nn.Linear in the model with its packed form; returns how many. With gemv (the
    linear_bf16 kernel module), inputs of 1-3 rows go through it."""
    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    for name, linear in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, PackedLinear.from_linear(linear, gemv))
    return len(targets)


def gemv_kernel(enabled: bool):
    """The matrix-vector kernel module when enabled and it builds and runs on this CPU, else None."""
    if not enabled:
        return None
    from twostep.kernels import linear_bf16

    return linear_bf16()


def _linear_of(weight: torch.Tensor) -> nn.Linear:
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype)
    linear.weight.data = weight
    return linear
