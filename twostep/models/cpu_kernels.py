"""The CPU fast paths a loaded model takes, in one place for the engine and the draft model:
oneDNN pre-packed bf16 linears, the C++ matrix-vector kernel for 1-3 row inputs, and RMSNorm (bf16)
and rotary as one C++ call each. Each is used only where it builds and works here."""
from __future__ import annotations

import torch

from twostep.kernels import elementwise
from twostep.layers.linear import PackedLinear, can_prepack, gemv_kernel, prepack_linears
from twostep.models.decoder import DecoderForCausalLM


def apply_cpu_kernels(model: DecoderForCausalLM, dtype: torch.dtype, device: torch.device,
                      prepack: bool = True, gemv: bool = True) -> list[str]:
    """Switch the model to the fast paths; returns what was switched on, for the log."""
    if device.type != "cpu":
        return []
    done = []
    if prepack and can_prepack(dtype, device):
        kernel = gemv_kernel(gemv)
        done.append(f"{prepack_linears(model, kernel)} linears pre-packed for oneDNN")
        if kernel is not None:
            done.append(f"1-3 row inputs: C++ matrix-vector kernel; it keeps {_kept_bytes(model) / 2**20:,.0f} "
                        "MiB of row-major weights beside the packed ones (--no-cpu-gemv to save them)")
    kernel = elementwise()
    if kernel is not None:
        model.use_elementwise_kernel(kernel)
        done.append("RMSNorm (bf16) and rotary: C++ kernel")
    return done


def _kept_bytes(model: DecoderForCausalLM) -> int:
    """Memory the row-major copies cost on top of the packed weights (a tied lm_head's is the
    embedding table, which exists anyway)."""
    shared = model.model.embed_tokens.weight.data_ptr()
    return sum(m.weight.numel() * m.weight.element_size() for m in model.modules()
               if isinstance(m, PackedLinear) and m.weight is not None and m.weight.data_ptr() != shared)
