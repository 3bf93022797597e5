"""Qwen3.5's GGUF files (llama.cpp's converter for `qwen35`, `qwen35moe`) tile a linear-attention
layer's value heads over its key heads, where HF's checkpoints (and twostep's layers) group them:
the orders that put a file's value-head rows, and out_proj's columns, back in HF's order, moving
packed quantized weights as they are where whole blocks allow."""
from __future__ import annotations

import dataclasses

import torch

from twostep.quantization.packed import BLOCK, QuantizedWeight


def _untiled(key_heads: int, value_heads: int, n: int) -> torch.Tensor:
    """Qwen3.5's files tile the value heads over the key heads (llama.cpp repeats the q/k heads
    whole: value head j' reads key head j' % key_heads); HF groups them (value head g * r + t reads key
    head g): the file's rows, n per head, in HF's order."""
    return torch.arange(value_heads * n).reshape(value_heads // key_heads, key_heads, n).transpose(0, 1).reshape(-1)


def value_head_rows(name: str, config: dict) -> torch.Tensor | None:
    """The row order that gives a value-head tensor of a tiled file (rows: values of in_proj_qkv and
    conv1d's channels, z, b, a, dt_bias, A_log) HF's order; None: not one."""
    if ".linear_attn." not in name:
        return None
    key_heads, value_heads = config["linear_num_key_heads"], config["linear_num_value_heads"]
    module = name.split(".linear_attn.")[1]
    dv, keys = config["linear_value_head_dim"], 2 * key_heads * config["linear_key_head_dim"]
    if module in ("in_proj_qkv.weight", "conv1d.weight"):      # q and k as they are
        return torch.cat([torch.arange(keys), keys + _untiled(key_heads, value_heads, dv)])
    if module == "in_proj_z.weight":
        return _untiled(key_heads, value_heads, dv)
    if module in ("in_proj_b.weight", "in_proj_a.weight", "dt_bias", "A_log"):
        return _untiled(key_heads, value_heads, 1)
    return None


def untiled_columns(weight: torch.Tensor | QuantizedWeight, config: dict) -> torch.Tensor | QuantizedWeight:
    """out_proj's columns (its input: the value heads) in HF's order. Packed, a value head moves as
    whole 32-weight blocks and scale groups, which a head of 64 or 128 dims is; a packed matrix of
    narrower heads (the tiny test models') cannot be reordered so: that one matrix is dequantized
    (requantizing in HF's order would round it twice)."""
    key_heads, value_heads, dv = (config["linear_num_key_heads"], config["linear_num_value_heads"],
                                  config["linear_value_head_dim"])
    if isinstance(weight, QuantizedWeight):
        heads = _column_blocks(weight, _untiled(key_heads, value_heads, 1), dv)
        if heads is not None:
            return heads
        weight = weight.dequantize()
    return weight[:, _untiled(key_heads, value_heads, dv)]


def _column_blocks(weight: QuantizedWeight, order: torch.Tensor, width: int) -> QuantizedWeight | None:
    """The packed matrix's columns in runs of `width`, run order[i] at i; None where a run is not made
    of whole blocks and scale groups. Every plane is [n, ...] row-major, block by block
    (quantization/packed.py): a run's planes are its columns' slices of each."""
    out = []
    for part in weight.parts:
        if part.panels or width % BLOCK or width % part.fmt.group or part.fmt.group > width:
            return None
        runs = [part.columns(int(i) * width, (int(i) + 1) * width) for i in order]
        planes = [None if plane is None else torch.cat([run.planes()[p] for run in runs], dim=1)
                  for p, plane in enumerate(part.planes())]
        out.append(dataclasses.replace(part, qs=planes[0], qh=planes[1], scales=planes[2], mins=planes[3]))
    return QuantizedWeight(tuple(out))
