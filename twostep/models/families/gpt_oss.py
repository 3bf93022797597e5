"""gpt-oss (20b, 120b): pre-norm layers alternating a 128-token sliding window and full attention,
q/k/v/o biases, a learned sink logit per head, YaRN; a mixture of experts in every layer routed by
the top k of biased router logits with a softmax over those k, each expert a clamped SwiGLU
((up + 1) * gate * sigmoid(1.702 gate), both clamped at 7) with biases. Its checkpoint stores the
experts as [E, in, out] with gate and up columns interleaved, or (the released checkpoints) in
MXFP4 as `*_blocks` [E, out, in / 32, 16] and `*_scales` with gate and up rows interleaved; they
load as the MoE block's [E * out, in] rows, MXFP4 kept packed (quantization/gguf_blocks.py)."""
from __future__ import annotations

import dataclasses

import torch

from twostep.models.causal_lm import CausalLM
from twostep.models.config import ModelConfig, base_config, moe_fields, sliding_window, window_layers
from twostep.models.family import Family, Tensors
from twostep.quantization.packed import QuantizedWeight


class GptOssForCausalLM(CausalLM):
    pass


def gpt_oss_config(cfg: dict, arch: str) -> ModelConfig:
    config = base_config(cfg, arch, qkv_bias=True, o_bias=True, attn_sinks=True,
                         sliding_window=sliding_window(cfg, always=True),
                         layer_types=window_layers(cfg, cfg["num_hidden_layers"], 2))
    return dataclasses.replace(
        config, **moe_fields(cfg), router="topk_softmax", router_bias=True, expert_bias=True,
        hidden_act="swiglu_oai", swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
        swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)))


def from_hf(tensors: Tensors, config: ModelConfig) -> Tensors:
    out = {}
    for name, t in tensors.items():
        name = name.replace(".mlp.router.", ".mlp.gate.")
        if name.endswith("mlp.experts.gate_up_proj"):           # [E, H, 2I], gate and up interleaved
            out[name.replace("gate_up_proj", "gate_proj.weight")] = _rows(t[..., 0::2])
            out[name.replace("gate_up_proj", "up_proj.weight")] = _rows(t[..., 1::2])
        elif name.endswith("mlp.experts.gate_up_proj_bias"):    # [E, 2I]
            out[name.replace("gate_up_proj_bias", "gate_proj.bias")] = t[:, 0::2].reshape(-1)
            out[name.replace("gate_up_proj_bias", "up_proj.bias")] = t[:, 1::2].reshape(-1)
        elif name.endswith("mlp.experts.gate_up_proj_blocks"):  # MXFP4, rows gate, up, gate, ...
            weight = _mxfp4(t, tensors[name.replace("_blocks", "_scales")])
            rows = torch.arange(weight.n).view(t.shape[0], t.shape[1])
            out[name.replace("gate_up_proj_blocks", "gate_proj.weight")] = weight.rows(rows[:, 0::2].reshape(-1))
            out[name.replace("gate_up_proj_blocks", "up_proj.weight")] = weight.rows(rows[:, 1::2].reshape(-1))
        elif name.endswith("mlp.experts.down_proj_blocks"):
            out[name.replace("down_proj_blocks", "down_proj.weight")] = _mxfp4(t, tensors[name.replace("_blocks", "_scales")])
        elif name.endswith(("mlp.experts.gate_up_proj_scales", "mlp.experts.down_proj_scales")):
            continue                                            # read with their blocks
        elif name.endswith("mlp.experts.down_proj"):            # [E, I, H]
            out[name + ".weight"] = _rows(t)
        elif name.endswith("mlp.experts.down_proj_bias"):
            out[name.replace("down_proj_bias", "down_proj.bias")] = t.reshape(-1)
        else:
            out[name] = t
    return out


def _mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> QuantizedWeight:
    """[E, n, k / 32, 16] blocks and [E, n, k / 32] scales -> the experts' [E * n, k], packed."""
    # here, not at the top: gguf_blocks needs the gguf package, and the set-up builds the kernels
    # through the CLI (which imports every family) while pip is still installing it
    from twostep.quantization.gguf_blocks import pack_mxfp4

    e, n, groups, _ = blocks.shape
    return QuantizedWeight((pack_mxfp4(blocks.reshape(e * n, groups, 16).numpy(),
                                       scales.reshape(e * n, groups).numpy()),))


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[E, in, out] (x @ w) -> [E * out, in] (a linear's rows, expert by expert)."""
    return t.transpose(1, 2).reshape(-1, t.shape[1]).contiguous()


GPT_OSS = Family("gpt_oss", GptOssForCausalLM, gpt_oss_config, ("GptOssForCausalLM",), ("gpt-oss",), from_hf)
