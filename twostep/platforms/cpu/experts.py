"""Quantized experts on the CPU (layers/moe.py's ExpertsMethod): a MoE layer's chosen experts over a
step's rows in one call of the quantized library (kernels/csrc/quant/experts.cpp), with the products
and the int8 activations the dense quantized linears use (quant_linear.py says where those apply).
The stacked weights stay packed as loaded; a call reads the chosen experts' rows only."""
from __future__ import annotations

import torch

from twostep import kernels
from twostep.platforms.cpu.quant_linear import QuantizedLinearMethod, _format_args
from twostep.platforms.step_kind import in_decode_batch

ACTIVATIONS = {"silu": 0, "swiglu_oai": 2}      # the kernel's activation numbers


class QuantizedExperts:
    def __init__(self, linear: QuantizedLinearMethod) -> None:
        self.linear, self.kernel = linear, linear.kernel
        self.name = f"quantized experts ({self.kernel.path()} kernel)"

    def bind(self, experts) -> None:
        """The kernel's arguments, once: each projection's planes checked, biases in float32."""
        if experts.act not in ACTIVATIONS:
            raise ValueError(f"the experts kernel has no {experts.act} activation")
        planes, biases = [], []
        for proj in (experts.gate_proj, experts.up_proj, experts.down_proj):
            parts = proj.quantized.parts
            if len(parts) != 1:
                raise ValueError(f"experts stacked from {len(parts)} formats ({', '.join(proj.quantized.format_names)})"
                                 ": the experts kernel takes one format per projection")
            part = parts[0]
            planes.append(self.kernel.checked_planes(*part.planes(), *_format_args(part), part.k))
            bias = getattr(proj, "plain_bias", None)
            biases.append(None if bias is None else bias.float().contiguous())
        experts.kernel_args = (*planes, experts.num_experts, ACTIVATIONS[experts.act], experts.alpha,
                               experts.limit or 0.0, *biases)

    def fused(self, experts, kernel) -> tuple | None:
        """The decode stack's arguments (kernels/csrc/decode_step.cpp's moe): the kernel's address,
        its arguments, and from how many rows a decode step takes the int8 products (0: never), as
        apply() decides in a decode batch. Only the platform's own build (not a test variant)."""
        if self.kernel is not kernels.quant_linear():
            return None
        int8_rows = self.linear.int8_rows if self.linear.int8_mode != "off" else 0
        return (self.kernel.experts_address(), *experts.kernel_args, int8_rows)

    def int8(self, x: torch.Tensor) -> bool:
        return self.linear.int8_for(x)

    def apply(self, experts, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        out = torch.empty_like(x)
        # a prompt's rows may take brgemm (oneDNN's: not while a user turns oneDNN off)
        gemm = not in_decode_batch() and torch.backends.mkldnn.enabled
        self.kernel.experts(x, ids.contiguous(), weights.contiguous(), *experts.kernel_args, self.int8(x), gemm, out)
        return out
