"""An op with a native PyTorch implementation that a platform may replace with a faster one,
picked once at load (vLLM's CustomOp: forward_native / forward_cpu / forward_cuda).

A subclass names its op (`op_name`), defines `forward_native` as a static function of tensors and
calls `self.impl` where it runs the op (RMSNorm in forward, RotaryEmbedding in the tables it hands
each step); impl is forward_native unless layers/dispatch.py bound the platform's implementation of
that op for the model's dtype. The layer itself knows no platform.
"""
from __future__ import annotations

from typing import Callable, ClassVar

from torch import nn


class CustomOp(nn.Module):
    op_name: ClassVar[str]
    forward_native: ClassVar[Callable]

    def __init__(self) -> None:
        super().__init__()
        self.impl: Callable = type(self).forward_native

    def use(self, impl: Callable | None) -> bool:
        """Run impl from now on (None: keep the native one); True when it was switched."""
        if impl is None:
            return False
        self.impl = impl
        return True
