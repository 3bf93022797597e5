"""A linear layer whose weight format is a pluggable method, as vLLM's LinearMethodBase.

The layer holds the checkpoint's parameters (weight [out, in], or `quantized`, a packed
QuantizedWeight, and an optional bias) and a LinearMethod that decides how they are stored and
multiplied: the plain PyTorch one here; a platform's (oneDNN pre-packed bf16 with a
matrix-vector kernel on CPU, platforms/cpu/linear.py) or its quantized one
(platforms/cpu/quant_linear.py), chosen once at load (layers/dispatch.py). The model file reads as the math either way.
"""
from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from twostep.quantization.packed import QuantizedWeight


class LinearMethod(Protocol):
    name: str

    def process_weights(self, layer: "Linear") -> None:
        """Once, after loading: convert layer.weight into what apply() reads (repack, quantize)."""
        ...

    def apply(self, layer: "Linear", x: torch.Tensor) -> torch.Tensor:
        ...

    def fused(self, layer: "Linear", kernel, dtype: torch.dtype) -> tuple[object, int | None] | None:
        """The layer as kernel.FusedLinear (twostep/kernels/csrc/decode_step.cpp) computing what apply()
        does in a decode step of `dtype` activations, and the most rows it may take that way (None:
        any); None where it cannot."""
        ...


class UnquantizedLinearMethod:
    """The weight as loaded, through F.linear."""

    name = "unquantized"

    def process_weights(self, layer: "Linear") -> None:
        return None

    def apply(self, layer: "Linear", x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight, layer.bias)

    def fused(self, layer: "Linear", kernel, dtype: torch.dtype) -> tuple[object, int | None]:
        bias = None if layer.bias is None else layer.bias.detach()
        linear = kernel.FusedLinear(layer.out_features, bias)
        linear.set_weight(layer.weight.detach(), False)      # at::linear, as F.linear
        return linear, None


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.quantized: QuantizedWeight | None = None     # set at load instead of weight (quantized formats)
        self.method: LinearMethod = UnquantizedLinearMethod()

    def set_method(self, method: LinearMethod) -> None:
        method.process_weights(self)
        self.method = method

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, method={self.method.name}")
