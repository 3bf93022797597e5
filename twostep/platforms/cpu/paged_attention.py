"""Paged decode attention on CPU through twostep/kernels/csrc/paged_attention.cpp: it reads each
sequence's K/V blocks where they lie in the cache, instead of gathering them, padding them to the
longest context and converting them. float32 math; one task per sequence and KV head, 16 positions
at a time. For unquantized float32 or bf16 caches (8-bit caches and other dtypes: no kernel)."""
from __future__ import annotations

from typing import Callable

import torch


def paged_decode_attention(kernel, dtype: torch.dtype, quantized_kv: bool) -> Callable | None:
    """fn(q [T, H, D], index [B, Q], query_lens [B], kv_values, tables [B, n], seq_lens [B], options)
    -> [B * Q, H, D] in q's dtype (float32, bf16 or fp16), or None where the kernel does not
    apply. The math is float32 either way. options: the layer's attention/options.py (scale, sliding
    window, soft cap, sinks), every one of them honoured by the kernel."""
    if kernel is None or quantized_kv or dtype not in (torch.float32, torch.bfloat16):
        return None

    def run(q, index, query_lens, values, tables, seq_lens, options):
        o = kernel.paged_decode_attention(q.contiguous(), index, query_lens, values, tables, seq_lens,
                                          options.scale, options.window or 0, options.softcap or 0.0, options.sinks)
        return o.view(-1, *q.shape[1:])

    return run
