"""Bind a loaded model's layers to its platform, once: each Linear gets the platform's linear
method for the model's dtype (if it has one), a quantized Linear or Embedding the platform's
quantized method with its weight in the layout the method prepares (or, without one, its weight
dequantized to the dtype), each CustomOp the
platform's implementation of its op (if any). What was switched on is returned for the start-up log."""
from __future__ import annotations

import logging
from collections import Counter

import torch
from torch import nn

from twostep.layers.custom_op import CustomOp
from twostep.layers.embedding import Embedding
from twostep.layers.gated_deltanet import GatedDeltaNet
from twostep.layers.linear import Linear
from twostep.layers.moe import ExpertLinear, Experts
from twostep.platforms import Platform

logger = logging.getLogger(__name__)


def apply_platform(model: nn.Module, platform: Platform, dtype: torch.dtype) -> list[str]:
    placed_before = platform.placed_bytes()
    for m in model.modules():
        if isinstance(m, Embedding):
            m.dtype = dtype            # what its lookups return, whatever the table's form
    done = _bind_quantized(model, platform, dtype)
    done += _bind_experts(model, platform)
    method = platform.linear_method(dtype)
    if method is not None:
        # experts in float run in torch from their stacked weights (layers/moe.py)
        linears = [m for m in model.modules() if isinstance(m, Linear) and m.quantized is None
                   and not isinstance(m, ExpertLinear)]
        for linear in linears:
            linear.set_method(method)
        done.append(f"{len(linears)} linears: {method.name}")
        narrowed = [m for m in linears if m.weight is not None and m.weight.dtype != dtype]
        if narrowed:
            done.append(f"{len(narrowed)} of them in {str(narrowed[0].weight.dtype).removeprefix('torch.')}, "
                        "widened exactly in the C++ matrix-vector kernel (--no-cpu-gemv: widened at load)")
        if getattr(method, "keeps_row_major", False):
            done.append(f"1-3 row inputs: C++ matrix-vector kernel; it keeps {_row_major_bytes(model) / 2**20:,.0f} "
                        "MiB of row-major weights beside the packed ones (--no-cpu-gemv to save them)")
    done += _bind_linear_attention(model, platform, dtype)
    switched = set()
    for m in model.modules():
        if isinstance(m, CustomOp):
            switched.update(name for name in list(m.impls) if m.use(name, platform.custom_op(name, dtype)))
    if switched:
        done.append(f"{', '.join(sorted(switched))}: {platform.name} kernels")
    placement = platform.weights_placement(placed_before)
    return done + ([placement] if placement else [])


def _bind_linear_attention(model: nn.Module, platform: Platform, dtype: torch.dtype) -> list[str]:
    """Gated DeltaNet layers' decodes as the platform's one call (conv, delta rule, gated norm)."""
    layers = [m for m in model.modules() if isinstance(m, GatedDeltaNet)]
    kernel = platform.gated_delta_decode(dtype) if layers else None
    if kernel is None:
        return []
    for m in layers:
        m.decode_kernel = kernel
    return [f"{len(layers)} linear-attention layers' decodes: {platform.name} kernel"]


def _bind_quantized(model: nn.Module, platform: Platform, dtype: torch.dtype) -> list[str]:
    layers = [m for m in model.modules() if isinstance(m, (Linear, Embedding)) and m.quantized is not None]
    if not layers:
        return []
    method = platform.quantized_linear_method()
    if method is None:
        logger.warning("no quantized kernel on the %s platform here: %d quantized weights are "
                       "dequantized to %s at load (more memory, slower decode)", platform.name, len(layers),
                       str(dtype).removeprefix("torch."))
        dequantized: dict[int, nn.Parameter] = {}        # a tied head and its embedding: one copy
        for m in layers:
            key = id(m.quantized)
            if key not in dequantized:
                weight = m.quantized.dequantize(dtype).to(platform.device)
                dequantized[key] = nn.Parameter(weight, requires_grad=False)
            m.weight, m.quantized = dequantized[key], None
        return [f"{len(layers)} quantized weights dequantized to {dtype} (no {platform.name} kernel)"]
    formats: Counter[str] = Counter()
    prepared: dict[int, tuple] = {}     # id -> (weight as loaded, as prepared); a tied head shares its table's
    for m in layers:
        key = id(m.quantized)
        if key not in prepared:
            prepared[key] = (m.quantized, method.prepare(m.quantized))
        m.quantized = prepared[key][1]
        formats.update(m.quantized.format_names)
        if isinstance(m, Linear):
            m.set_method(method)
        else:
            m.weight, m.method, m.dtype = None, method, dtype
    kinds = ", ".join(f"{count} {name}" for name, count in sorted(formats.items()))
    return [f"{len(layers)} quantized linears and embeddings ({kinds}): {method.name}"]


def _bind_experts(model: nn.Module, platform: Platform) -> list[str]:
    """Quantized experts: the platform's experts method (float ones stay with torch's)."""
    layers = [m for m in model.modules() if isinstance(m, Experts) and m.gate_proj.quantized is not None]
    if not layers:
        return []
    method = platform.experts_method()
    if method is None:
        raise ValueError(f"quantized experts need the {platform.name} platform's experts kernel, which did not load")
    for m in layers:
        m.set_method(method)
    return [f"{len(layers)} MoE layers: {method.name}"]


def weight_bytes(model: nn.Module) -> int:
    """Memory the model's weights take as bound: parameters, packed and quantized forms, each
    tensor counted once (a tied head shares its embedding's)."""
    seen: dict[int, int] = {}
    for m in model.modules():
        tensors = [p for p in m.parameters(recurse=False)]
        tensors += [getattr(m, a, None) for a in ("packed_weight", "row_major_weight", "plain_bias")]
        for t in tensors:
            if isinstance(t, torch.Tensor):
                seen[_storage_key(t)] = t.numel() * t.element_size()
        quantized = getattr(m, "quantized", None)
        if quantized is not None:
            seen[id(quantized)] = quantized.nbytes
    return sum(seen.values())


def streamed_weight_bytes(model: nn.Module) -> int:
    """Bytes of weights a batch-1 decode step reads: every Linear's form the matrix-vector product
    takes, each tensor once (a tied lm_head is read as the head; the embedding's one row is not
    counted); of stacked experts, the share one token's experts are."""
    seen: dict[int, int] = {}
    for m in model.modules():
        if not isinstance(m, Linear):
            continue
        share = m.active / m.num_experts if isinstance(m, ExpertLinear) else 1
        if m.quantized is not None:
            seen[id(m.quantized)] = int(m.quantized.nbytes * share)
            continue
        w = next(t for t in (getattr(m, a, None) for a in ("row_major_weight", "packed_weight", "weight"))
                 if isinstance(t, torch.Tensor))
        seen[_storage_key(w)] = int(w.numel() * w.element_size() * share)
    return sum(seen.values())


def _storage_key(t: torch.Tensor) -> int:
    """One key per stored tensor, so a shared one (a tied head) counts once; an opaque (oneDNN)
    tensor has no data pointer and is its own."""
    try:
        return t.data_ptr()
    except RuntimeError:
        return id(t)


def _row_major_bytes(model: nn.Module) -> int:
    """Memory the row-major copies cost on top of the packed weights (a tied lm_head's is the
    embedding table, which exists anyway)."""
    shared = {m.weight.data_ptr() for m in model.modules() if isinstance(m, Embedding) and m.weight is not None}
    kept = [getattr(m, "row_major_weight", None) for m in model.modules() if isinstance(m, Linear)]
    return sum(w.numel() * w.element_size() for w in kept if w is not None and w.data_ptr() not in shared)
