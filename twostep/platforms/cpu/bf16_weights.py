"""bf16 weights in a float32 model: a bf16 checkpoint run in float32 (the default dtype on CPUs
without native bf16, such as an AVX2-only EPYC) keeps its linear weights in bf16, and a decode step
streams half the bytes. The math is unchanged: a bf16 number is a float32 whose low 16 bits are
zero, so the kernel widens each weight exactly and multiplies in float32, as F.linear on the
float32 weight does (the sums in another order, within float32 rounding).

A layer's weight is kept in bf16 only where every value of it is a bf16 value (a float32 checkpoint
keeps its float32 weights and F.linear). Inputs of up to GEMV_MAX_ROWS rows take the kernel
(kernels/csrc/linear_bf16.cpp: AVX2 or plain C++), more rows a float32 tile of the weight at a time
through F.linear (MKL): prefill is compute-bound, and widening a tile costs a read of it. A tied
embedding shares the narrowed table (layers/embedding.py widens the rows it looks up).

The kernel stops at 64 rows, short of where widening tiles started to win on an AVX2-only EPYC
(benchmarks/RESULTS.md): a margin for CPUs whose float32 GEMM is faster. The platform takes this
method where the kernel's float32 path is AVX2 (the plain C++ one is slower than F.linear).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from twostep.platforms.cpu.huge_pages import HugePageArena

GEMV_MAX_ROWS = 64             # up to this many rows the kernel (passes of 4 rows), more: tiles (measured)
TILE_BYTES = 4 << 20           # float32 bytes of weight widened at once for more rows


def holds_bf16_values(weight: torch.Tensor) -> bool:
    """Whether every value of a float32 tensor is exactly a bf16 (its low 16 bits are zero)."""
    if weight.dtype != torch.float32:
        return False
    bits = weight.detach().contiguous().view(torch.int32).view(-1)
    step = TILE_BYTES // 4                  # a tile at a time: no temporary the size of the table
    return not any(bool(torch.any(bits[i:i + step] & 0xFFFF)) for i in range(0, bits.numel(), step))


class Bf16WeightsLinearMethod:
    """A LinearMethod (layers/linear.py) for float32 models: a layer whose weight holds only bf16
    values gets it narrowed to bf16 in place (layer.weight.data); the others keep F.linear."""

    name = "float32, weights that hold only bf16 values kept in bf16"

    def __init__(self, kernel, arena: HugePageArena | None = None) -> None:
        self.kernel = kernel          # the linear_bf16 module (float32 inputs)
        self.arena = arena            # where narrowed weights go (huge pages), or None

    def process_weights(self, layer) -> None:
        weight = layer.weight.detach()
        if not holds_bf16_values(weight):
            return
        narrowed = weight.to(torch.bfloat16).contiguous()     # the kernel reads it row-major
        layer.weight.data = narrowed if self.arena is None else self.arena.place(narrowed)

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        weight, bias = layer.weight, layer.bias
        if weight.dtype != torch.bfloat16:
            return F.linear(x, weight, bias)
        if x.numel() <= GEMV_MAX_ROWS * layer.in_features and x.dtype == torch.float32:
            return self.kernel.linear_bf16(x, weight.detach(), None if bias is None else bias.detach())
        return widened_linear(x, weight.detach(), bias)

    def fused(self, layer, kernel, dtype: torch.dtype):
        """Up to GEMV_MAX_ROWS rows through the same linear_bf16 op (more: not fused); a float32
        weight through at::linear, as F.linear."""
        bias = None if layer.bias is None else layer.bias.detach()
        linear = kernel.FusedLinear(layer.out_features, bias)
        narrowed = layer.weight.dtype == torch.bfloat16
        linear.set_weight(layer.weight.detach(), narrowed)
        return linear, GEMV_MAX_ROWS if narrowed else None


def widened_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, weight.float(), bias), widening TILE_BYTES of the weight at a time."""
    rows = max(1, TILE_BYTES // (4 * weight.shape[1]))
    if rows >= weight.shape[0]:
        return F.linear(x, weight.to(x.dtype), bias)
    parts = [F.linear(x, weight[n:n + rows].to(x.dtype), None if bias is None else bias[n:n + rows])
             for n in range(0, weight.shape[0], rows)]
    return torch.cat(parts, dim=-1)
