"""`twostep env`: what this CPU has, what twostep chooses from it, and which kernel paths run here."""
from __future__ import annotations

import os

import torch

from twostep import kernels
from twostep.kernels.cpu_features import cpu_flags, cpu_name
from twostep.platforms.cpu.huge_pages import thp_setting

# the instruction sets the kernels choose between, in the order they matter
FEATURES = ("avx2", "fma", "avx_vnni", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_bf16")


def describe(platform) -> list[str]:
    """Lines for a terminal: the CPU, its default dtype and why, each kernel's build and paths."""
    flags = cpu_flags()
    present = [f for f in FEATURES if f in flags]
    absent = [f for f in FEATURES if f not in flags]
    lines = [(f"CPU: {cpu_name()}, {len(os.sched_getaffinity(0))} cores for this process, "
              f"torch {torch.__version__} with {torch.get_num_threads()} threads"),
             (f"instruction sets: {' '.join(present) or 'none of ' + ' '.join(FEATURES)}"
              + (f" (not: {' '.join(absent)})" if absent else "")),
             (f"default dtype: {str(platform.default_dtype()).removeprefix('torch.')}, as "
              f"{platform.default_dtype_reason()}"),
             f"transparent huge pages: {thp_setting()}",
             "kernels (built for this CPU on first use; `twostep build-kernels` builds them all):"]
    return lines + [f"  {line}" for line in _kernel_lines()]


def _kernel_lines() -> list[str]:
    quant, gemv = kernels.quant_linear(), kernels.linear_bf16()
    lines = []
    if quant is None:
        lines.append("quantized products: not built (PyTorch on dequantized weights)")
    else:
        int8 = (f"int8 activations for {', '.join(map(str, quant.int8_bits()))}-bit codes from "
                f"{quant.int8_min_rows()} row(s)") if quant.has_int8() else "no int8 product"
        lines.append(f"quantized products: the {quant.path()} path, "
                     f"{'panel' if quant.has_panels() else 'row'} layout, {int8}; prompts: "
                     f"bf16 brgemm {_yes(quant.has_bf16_gemm())}, float32 brgemm {_yes(quant.has_f32_gemm())}")
    if gemv is None:
        lines.append("bf16-weight matrix-vector product: not built (oneDNN / F.linear)")
    else:
        lines.append(f"bf16-weight matrix-vector product: bf16 inputs {_yes(gemv.has_bf16_dot())} "
                     f"(AVX512-BF16), float32 inputs through the {gemv.float32_path()} path")
    attention = kernels.paged_attention()
    lines.append("paged decode attention: " + ("not built (PyTorch)" if attention is None else
                                                f"built, bf16 dot products {_yes(attention.has_bf16_dot())}"))
    lines.append(f"norms, rotary, SiLU, K/V write: {'built' if kernels.elementwise() else 'not built (PyTorch)'}")
    lines.append(f"one-call decode stack: {'built' if kernels.decode_step() else 'not built (layer by layer)'}")
    return lines


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"
