"""The CPU platform: bf16 by default where the CPU computes it in hardware, else float32; oneDNN pre-packed bf16
linears with a matrix-vector kernel for 1-3 rows (linear.py), a float32 model's bf16-valued weights
kept in bf16 (bf16_weights.py), quantized weights read packed
(quant_linear.py), RMSNorm, rotary, SiLU-and-multiply and the K/V cache write
as one C++ call each (elementwise.py), paged decode attention in C++ (paged_attention.py), a Gated
DeltaNet layer's decode step in one C++ call (gated_delta.py), and a
decode step's layers composed of those in one C++ call (kernels/csrc/decode_step.cpp). Each only where its
kernel builds and runs on this CPU (twostep/kernels builds them on first use)."""
from __future__ import annotations

from typing import Callable

import torch

from twostep import kernels
from twostep.kernels.cpu_features import cpu_flags
from twostep.config.engine import EngineConfig
from twostep.platforms.cpu.bf16_weights import Bf16WeightsLinearMethod
from twostep.platforms.cpu.elementwise import elementwise_op
from twostep.platforms.cpu.experts import QuantizedExperts
from twostep.platforms.cpu.gated_delta import gated_delta_decode
from twostep.platforms.cpu.huge_pages import HugePageArena, give_back_freed_memory, thp_setting
from twostep.platforms.cpu.linear import PackedLinearMethod, can_prepack
from twostep.platforms.cpu.paged_attention import paged_decode_attention
from twostep.platforms.cpu.quant_linear import QuantizedLinearMethod
from twostep.platforms.interface import Platform


class CpuPlatform(Platform):
    name = "cpu"

    def __init__(self, device: torch.device, config: EngineConfig | None = None) -> None:
        super().__init__(device)
        self.config = config = config or EngineConfig()     # its cpu_* options
        self._linear_methods: dict[torch.dtype, PackedLinearMethod | None] = {}
        # the weights a decode step streams, copied there at load (huge_pages.py)
        self.arena = HugePageArena() if config.cpu_huge_pages and HugePageArena.available() else None

    def default_dtype(self) -> torch.dtype:
        """bfloat16 where the CPU computes it in hardware, else float32 (never float16 on CPU, whose
        matmuls fall back to a scalar path). See docs/architecture.md for the measurement."""
        return torch.bfloat16 if has_native_bf16() else torch.float32

    def default_dtype_reason(self) -> str:
        found = sorted(NATIVE_BF16_FLAGS & cpu_flags())
        if found:
            return f"this CPU computes bf16 in hardware ({', '.join(found)})"
        return ("this CPU has no " + " or ".join(sorted(NATIVE_BF16_FLAGS)) + ": bf16 matmuls would be "
                "emulated; bf16 weights stay bf16 in memory, widened as they are read")

    def linear_method(self, dtype: torch.dtype) -> PackedLinearMethod | Bf16WeightsLinearMethod | None:
        if dtype not in self._linear_methods:
            self._linear_methods[dtype] = self._make_linear_method(dtype)
        return self._linear_methods[dtype]

    def _make_linear_method(self, dtype: torch.dtype) -> PackedLinearMethod | Bf16WeightsLinearMethod | None:
        kernel = kernels.linear_bf16() if self.config.cpu_gemv else None
        if dtype == torch.float32:       # bf16 weights kept in bf16 (bf16_weights.py)
            # on the AVX2 path only: the plain C++ one (for tests) ran 1.7x slower than F.linear on
            # the float32 weights at one row on an x86-64 baseline build
            usable = kernel is not None and kernel.has_float32_path() and kernel.float32_path() == "AVX2"
            return Bf16WeightsLinearMethod(kernel, self.arena) if usable else None
        if not (self.config.cpu_prepack_weights and can_prepack(dtype, self.device)):
            return None
        return PackedLinearMethod(kernel if kernel is not None and kernel.has_bf16_dot() else None, self.arena)

    def quantized_linear_method(self) -> QuantizedLinearMethod | None:
        kernel = kernels.quant_linear()
        return None if kernel is None else QuantizedLinearMethod(kernel, self.config.cpu_int8_activations, self.arena)

    def experts_method(self) -> QuantizedExperts | None:
        method = self.quantized_linear_method()
        return None if method is None else QuantizedExperts(method)

    def place_streamed(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.arena is None else self.arena.place(t)

    def placed_bytes(self) -> int:
        return 0 if self.arena is None else self.arena.placed_bytes

    def weights_placement(self, placed_before: int) -> str | None:
        placed = self.placed_bytes() - placed_before      # a draft model shares the target's platform
        if placed:
            return (f"{placed / 2**20:,.0f} MiB of weights in memory advised for 2 MiB pages "
                    f"(transparent huge pages: {thp_setting()})")
        if self.config.cpu_huge_pages and not HugePageArena.available():
            return f"weights in 4 KiB pages (transparent huge pages: {thp_setting()})"
        return None

    def release_memory(self) -> None:
        """glibc keeps the heap that loading freed (numpy temporaries of the GGUF repacking: 223 MiB
        for a 505 MiB Q8_0 file) unless asked."""
        give_back_freed_memory()

    def custom_op(self, name: str, dtype: torch.dtype) -> Callable | None:
        return elementwise_op(kernels.elementwise(), name, dtype)

    def paged_decode_attention(self, dtype: torch.dtype, quantized_kv: bool) -> Callable | None:
        return paged_decode_attention(kernels.paged_attention(), dtype, quantized_kv)

    def kv_cache_write(self, dtype: torch.dtype, quantized_kv: bool) -> Callable | None:
        kernel = kernels.elementwise()
        if kernel is None or quantized_kv or dtype not in (torch.float32, torch.bfloat16):
            return None
        return kernel.write_kv

    def gated_delta_decode(self, dtype: torch.dtype) -> Callable | None:
        return gated_delta_decode(kernels.gated_delta(), dtype)

    def decode_step_kernel(self):
        return kernels.decode_step()


# bf16 arithmetic in hardware: AVX512-BF16's dot products (Zen 4 and later, Cooper Lake, Sapphire
# Rapids) or AMX's bf16 tiles. oneDNN also "supports" bf16 on any AVX-512 CPU (Skylake, Ice Lake) by
# emulating it, several times slower than its float32 matmul: not native.
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def has_native_bf16() -> bool:
    """Whether this CPU's flags name an instruction that computes bf16 (NATIVE_BF16_FLAGS)."""
    return bool(NATIVE_BF16_FLAGS & cpu_flags())
