"""What a platform decides, once at load: the default dtype, and for each op that has a faster
platform implementation (a linear method, "rms_norm", "rotary", paged decode attention) whether to
use it for this dtype. This base class answers with PyTorch's native code everywhere."""
from __future__ import annotations

from typing import Callable

import torch


class Platform:
    name = "native"

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def default_dtype(self) -> torch.dtype:
        if self.device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32

    def default_dtype_reason(self) -> str:
        """Why default_dtype() is what it is, for the start-up log and `twostep env`."""
        return "the device's default"

    def linear_method(self, dtype: torch.dtype):
        """A LinearMethod (layers/linear.py) for unquantized weights of this dtype, or None: F.linear."""
        return None

    def quantized_linear_method(self):
        """A LinearMethod for QuantizedWeight layers that also embeds (layers/embedding.py), or
        None: such weights are dequantized at load to the model's dtype."""
        return None

    def experts_method(self):
        """An ExpertsMethod (layers/moe.py) for quantized experts, or None: their weights are
        dequantized at load and the experts run in torch."""
        return None

    def place_streamed(self, t: torch.Tensor) -> torch.Tensor:
        """t in the memory this platform keeps the weights a decode step streams in (a copy), or t."""
        return t

    def placed_bytes(self) -> int:
        """Bytes place_streamed and this platform's linear methods have copied so far."""
        return 0

    def weights_placement(self, placed_before: int) -> str | None:
        """A line for the start-up log on where the weights bound since placed_bytes() was
        placed_before live (huge pages), or None."""
        return None

    def release_memory(self) -> None:
        """Give memory freed while loading back to the operating system, where that needs asking."""
        return None

    def custom_op(self, name: str, dtype: torch.dtype) -> Callable | None:
        """This platform's implementation of a CustomOp (layers/custom_op.py), or of the sampler's
        greedy pick ("first_argmax", sample/argmax.py), or None: native."""
        return None

    def paged_decode_attention(self, dtype: torch.dtype, quantized_kv: bool) -> Callable | None:
        """A kernel for decode attention over the paged cache (attention/paged_decode.py), or None."""
        return None

    def kv_cache_write(self, dtype: torch.dtype, quantized_kv: bool) -> Callable | None:
        """fn(cache values, k, v, slots) storing new K/V in an unquantized cache of this dtype in
        one call (attention/kv_layer_cache.py's write_kv otherwise), or None."""
        return None

    def gated_delta_decode(self, dtype: torch.dtype) -> Callable | None:
        """fn(mixed_qkv, z, a, b, conv_state, recurrent, slots, conv_weight, A_log, dt_bias,
        norm_weight, eps, num_k_heads, head_k_dim, head_v_dim) -> out: a Gated DeltaNet layer's decode
        step for B sequences of one token each in one call, its conv and recurrent states updated in
        place at the sequences' slots (platforms/cpu/gated_delta.py has the shapes), or None: PyTorch."""
        return None

    def decode_step_kernel(self):
        """A module with DecoderStack and FusedLinear (twostep/kernels/csrc/decode_step.cpp) running a
        decode step's layers in one call (models/fused_decode.py), or None: layer by layer."""
        return None
