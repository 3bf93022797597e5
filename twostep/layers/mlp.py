"""The gated MLP: one fused gate/up projection, the family's activation, down (vLLM's LlamaMLP).
Under tensor parallelism a rank holds a share of the intermediate features; the sum after
down_proj meets the other ranks."""
from __future__ import annotations

import torch
from torch import nn

from twostep.distributed.parallel import TensorParallel
from twostep.layers.activation import ACTIVATIONS
from twostep.layers.linear import Linear


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, act: str, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)
        self.act_name = act
        self.act = ACTIVATIONS[act]()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.down_proj(self.act(self.gate_up_proj(x))))

    def emit(self, p, dst: int, src: int) -> None:
        """forward as the decode program's instructions (models/fused_decode.py), through dst."""
        p.linear(dst, src, self.gate_up_proj)
        p.act(dst, dst, self.act_name)
        p.linear(dst, dst, self.down_proj)
