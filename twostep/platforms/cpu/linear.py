"""bf16 linears on CPU: weights pre-packed once for oneDNN, and a C++ matrix-vector kernel for
inputs of one to three rows. A linear method (layers/linear.py) the CPU platform offers for bf16.

torch's plain bf16 matmul re-reads the weight in its stored layout every call; oneDNN with a
pre-packed (blocked) weight runs 1.1x (prefill) to 1.7x (a few rows) faster (benchmarks/
bench_linear.py). Its results are bit-identical to F.linear in bf16, which the tests check. These
are private torch ops, so they are used only behind a check that they exist and work.

Batch-1 decode is one matrix-vector product per linear: there twostep/kernels/csrc/linear_bf16.cpp
streams the row-major weight at ~1.3x oneDNN's packed GEMV (93% of a plain read of the same bytes);
the two are even at 4 rows and oneDNN wins from there (benchmarks/bench_linear.py). The kernel
reads the weight as stored, so a layer that uses it keeps the row-major weight beside the packed
one (a tied lm_head's is the embedding table, already in memory). It accumulates in float32 in
another order than oneDNN: within bf16 rounding, not bit-identical.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F

from twostep.platforms.cpu.huge_pages import HugePageArena

GEMV_MAX_ROWS = 3   # inputs with at most this many rows take the matrix-vector kernel (measured)


class PackedLinearMethod:
    """Replaces the layer's parameters with plain tensors (read on every call without nn.Module's
    attribute lookup): packed_weight for oneDNN, row_major_weight for the gemv kernel (None
    without it), plain_bias."""

    def __init__(self, gemv=None, arena: HugePageArena | None = None) -> None:
        self.gemv = gemv                        # the linear_bf16 kernel module, or None
        self.arena = arena                      # where the row-major weight goes (huge pages), or None
        self.name = "oneDNN packed" + (" + matrix-vector kernel" if gemv is not None else "")

    @property
    def keeps_row_major(self) -> bool:
        return self.gemv is not None

    def process_weights(self, layer) -> None:
        if self.gemv is not None and self.arena is not None:
            # the matrix-vector kernel streams it: into the arena in place, so that a tied
            # embedding (the same Parameter) reads the copy too
            layer.weight.data = self.arena.place(layer.weight.detach().contiguous())
        weight = layer.weight.detach()
        layer.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
        layer.row_major_weight = weight.contiguous() if self.gemv is not None else None
        layer.plain_bias = None if layer.bias is None else layer.bias.detach()
        layer.weight = layer.bias = None        # a tied lm_head's weight lives on in the embedding

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        if self.gemv is not None and x.numel() <= GEMV_MAX_ROWS * layer.in_features:
            return self.gemv.linear_bf16(x, layer.row_major_weight, layer.plain_bias)
        return torch.ops.mkldnn._linear_pointwise(x, layer.packed_weight, layer.plain_bias, "none", [], "")

    def fused(self, layer, kernel, dtype: torch.dtype):
        """Rows up to GEMV_MAX_ROWS through the same linear_bf16 op (more take oneDNN: not fused)."""
        if self.gemv is None:
            return None
        linear = kernel.FusedLinear(layer.out_features, layer.plain_bias)
        linear.set_weight(layer.row_major_weight, True)
        return linear, GEMV_MAX_ROWS


def can_prepack(dtype: torch.dtype, device: torch.device) -> bool:
    """bf16 on a CPU where oneDNN runs bf16 (in hardware, or emulated on AVX-512 without it: asked
    for with --dtype bfloat16, packed is still oneDNN's faster way), and the private ops behave."""
    if device.type != "cpu" or dtype != torch.bfloat16:
        return False
    try:
        if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return False
        w = torch.randn(8, 16).to(dtype)
        x = torch.randn(3, 16).to(dtype)
        return torch.equal(packed_linear(w)(x), F.linear(x, w))
    except (AttributeError, RuntimeError):
        return False


def packed_linear(weight: torch.Tensor, bias: torch.Tensor | None = None, gemv=None):
    """A callable x -> linear(x) through PackedLinearMethod, without a model (checks, benchmarks)."""
    layer = SimpleNamespace(weight=weight, bias=bias, in_features=weight.shape[1])
    method = PackedLinearMethod(gemv)
    method.process_weights(layer)
    return lambda x: method.apply(layer, x)
