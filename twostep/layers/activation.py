"""The gated MLP's activations: x = [gate, up] -> act(gate) * up, SiLU or GELU-tanh (vLLM's
SiluAndMul). A platform may supply it as one call (the CPU's: platforms/cpu/elementwise.py)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from twostep.layers.custom_op import CustomOp


def silu_and_mul_native(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class SiluAndMul(CustomOp):
    native_ops = {"silu_and_mul": silu_and_mul_native}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.impls["silu_and_mul"](x)


def gelu_tanh_and_mul_native(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


class GeluTanhAndMul(CustomOp):
    """GELU (tanh approximation) gating: Gemma's MLP (HF's gelu_pytorch_tanh)."""

    native_ops = {"gelu_tanh_and_mul": gelu_tanh_and_mul_native}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.impls["gelu_tanh_and_mul"](x)


ACTIVATIONS = {"silu": SiluAndMul, "gelu_tanh": GeluTanhAndMul}
