"""A checkpoint's tensors (float, or packed quantized ones) cut to one tensor-parallel rank's share (distributed/parallel.py
says which), by HF name, before q/k/v and gate/up are fused; and the config of the model a rank
builds (its heads and intermediate features; the vocabulary stays whole in the config, the
embedding and lm_head hold the rank's slice). Experts are split along their intermediate size:
each rank holds every expert's share of it (the rows of its gate and up, the columns of its down),
and the router whole."""
from __future__ import annotations

import dataclasses
import re

import torch

from twostep.distributed.parallel import TensorParallel
from twostep.models.config import ModelConfig
from twostep.quantization.packed import QuantizedWeight

_LAYER = re.compile(r"model\.layers\.\d+\.(.+)")


def local_config(config: ModelConfig, tp: TensorParallel) -> ModelConfig:
    kv_start, kv_end = tp.kv_heads(config.num_heads, config.num_kv_heads)
    tp.split(config.vocab_size, "vocabulary entries")
    if config.num_experts:
        tp.split(config.moe_intermediate_size, "expert intermediate features")
    return dataclasses.replace(config, num_heads=config.num_heads // tp.world_size, num_kv_heads=kv_end - kv_start,
                               intermediate_size=config.intermediate_size // tp.world_size,
                               moe_intermediate_size=config.moe_intermediate_size // tp.world_size,
                               shared_expert_intermediate_size=config.shared_expert_intermediate_size // tp.world_size)


def shard_tensors(tensors: dict, config: ModelConfig, tp: TensorParallel) -> dict[str, torch.Tensor]:
    """This rank's part of every tensor (norms whole; a row-parallel bias on rank 0 only)."""
    if not tp.enabled:
        return tensors
    d = config.head_dim
    q = [s * d for s in tp.split(config.num_heads, "attention heads")]
    kv = [s * d for s in tp.kv_heads(config.num_heads, config.num_kv_heads)]
    ff = tp.split(config.intermediate_size, "intermediate features")
    vocab = tp.split(config.vocab_size, "vocabulary entries")
    heads = tp.split(config.num_heads, "attention heads")
    expert = tp.split(config.moe_intermediate_size, "expert intermediate features") if config.num_experts else None
    shared = config.shared_expert_intermediate_size
    sh = tp.split(shared, "shared expert intermediate features") if shared else None
    rows = {"self_attn.q_proj": q, "self_attn.k_proj": kv, "self_attn.v_proj": kv,
            "mlp.gate_proj": ff, "mlp.up_proj": ff, "mlp.shared_expert.gate_proj": sh, "mlp.shared_expert.up_proj": sh}
    cols = {"self_attn.o_proj": q, "mlp.down_proj": ff, "mlp.experts.down_proj": expert,
            "mlp.shared_expert.down_proj": sh}
    per_expert = ("mlp.experts.gate_proj", "mlp.experts.up_proj")
    out = {}
    for name, t in tensors.items():
        module, kind = name.rsplit(".", 1)
        layer = _LAYER.fullmatch(module)
        part = layer.group(1) if layer else module
        if name.endswith("self_attn.sinks"):      # one per query head
            out[name] = t[heads[0]:heads[1]].contiguous()
        elif part in per_expert:
            out[name] = _expert_rows(t, config.num_experts, *expert)
        elif part in rows:
            out[name] = _rows(t, *rows[part])
        elif part in cols and kind == "weight":
            out[name] = _columns(t, *cols[part])
        elif part in cols:                        # added once, after the all-reduce
            out[name] = t if tp.rank == 0 else torch.zeros_like(t)
        elif part in ("model.embed_tokens", "lm_head"):
            out[name] = _rows(t, *vocab)
        else:
            out[name] = t
    return out


def _rows(t, start: int, end: int):
    """Output rows start..end of a float tensor or a packed quantized weight (GGUF types,
    --quantization): packed rows cut as they are."""
    if isinstance(t, QuantizedWeight):
        return t.row_range(start, end)
    return t[start:end].contiguous()


def _expert_rows(t, experts: int, start: int, end: int):
    """Rows start..end of each expert's block of a stacked [E * n, k] weight (or [E * n] bias)."""
    n = (t.n if isinstance(t, QuantizedWeight) else t.shape[0]) // experts
    if isinstance(t, QuantizedWeight):
        return QuantizedWeight.stack([t.row_range(e * n + start, e * n + end) for e in range(experts)])
    return t.view(experts, n, *t.shape[1:])[:, start:end].reshape(-1, *t.shape[1:]).contiguous()


def _columns(t, start: int, end: int):
    """Input columns start..end: a packed weight is cut at whole blocks and groups."""
    if isinstance(t, QuantizedWeight):
        return t.columns(start, end)
    return t[:, start:end].contiguous()
