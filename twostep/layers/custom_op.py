"""Ops with a native PyTorch implementation that a platform may replace with a faster one, picked
once at load (vLLM's CustomOp: forward_native / forward_cpu / forward_cuda).

A subclass lists its ops (`native_ops`: op name -> a static function of tensors) and calls
`self.impls[name]` where it runs one (RMSNorm: "rms_norm" and "add_rms_norm"); an entry is the
native function unless layers/dispatch.py bound the platform's implementation of that op for the
model's dtype. The layer itself knows no platform.
"""
from __future__ import annotations

from typing import Callable, ClassVar

from torch import nn


class CustomOp(nn.Module):
    native_ops: ClassVar[dict[str, Callable]]

    def __init__(self) -> None:
        super().__init__()
        self.impls: dict[str, Callable] = dict(self.native_ops)

    def use(self, name: str, impl: Callable | None) -> bool:
        """Run impl for op `name` from now on (None: keep the native one); True when it was switched."""
        if impl is None:
            return False
        self.impls[name] = impl
        return True
