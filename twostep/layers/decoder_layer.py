"""The decoder layers families are made of, differing only in where their norms sit. Each takes
x, the previous layer's output, and residual, the stream before it (None at the first layer, where
x is the embedding), and returns the same pair for the next layer; the stream is residual + x.
A residual add is fused into the norm that follows it (RMSNorm(x, residual) adds in place).

- PreNormLayer (Llama, Mistral, Qwen, Phi-3, SmolLM3, Granite): x + attn(norm(x)), then the same with the MLP.
- SandwichNormLayer (Gemma 2/3, GLM-4): each sub-layer's output is normed again before the add.
- PostNormLayer (OLMo 2): no norm before a sub-layer, one on its output before the add.

A layer's token mixer is attention (self_attn), or in a hybrid model's linear-attention layers a
Gated DeltaNet (linear_attn, layers/gated_deltanet.py); `mixer` is whichever it has.
"""
from __future__ import annotations

import torch
from torch import nn

from twostep.distributed.parallel import TensorParallel
from twostep.layers.attention import Attention
from twostep.layers.gated_deltanet import GatedDeltaNet
from twostep.layers.mlp import GatedMLP
from twostep.layers.moe import SparseMoE
from twostep.layers.norm import RMSNorm

# The decode program's registers (models/fused_decode.py): a layer's output, scratch, the residual
# stream. Each layer's emit() hands the program the instructions its forward() computes.
X, H, R = 0, 1, 2


class DecoderLayer(nn.Module):
    norm_names: tuple[str, ...] = ()        # its RMSNorms over the hidden state

    def __init__(self, cfg, layer: int, tp: TensorParallel) -> None:
        super().__init__()
        self.is_linear = cfg.is_linear_layer(layer)
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(cfg, layer, tp)
        else:
            self.self_attn = Attention(cfg, layer, tp)
        self.mlp = SparseMoE(cfg, tp) if cfg.is_moe_layer(layer) else \
            GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, tp)

    @property
    def mixer(self) -> nn.Module:
        """Attention, or a linear-attention layer's Gated DeltaNet."""
        return self.linear_attn if self.is_linear else self.self_attn

    def norm(self, cfg) -> RMSNorm:
        return RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def normed_input(self, x, residual) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_layernorm of the stream, the stream): at the first layer the stream is x itself."""
        if residual is None:
            return self.input_layernorm(x), x
        return self.input_layernorm(x, residual), residual

    def emit_normed_input(self, p, first: bool) -> None:
        """normed_input into H, the stream into R."""
        if first:
            p.set_residual(X)
            p.norm(H, X, self.input_layernorm)
        else:
            p.add_norm(H, X, self.input_layernorm)


class PreNormLayer(DecoderLayer):
    norm_names = ("input_layernorm", "post_attention_layernorm")

    def __init__(self, cfg, layer: int, tp: TensorParallel) -> None:
        super().__init__(cfg, layer, tp)
        self.input_layernorm = self.norm(cfg)
        self.post_attention_layernorm = self.norm(cfg)
        self.residual_scale = cfg.residual_scale        # Granite's residual_multiplier

    def forward(self, x, residual, ropes, kv_cache, meta, backend) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.normed_input(x, residual)
        h = self.mixer(h, ropes, kv_cache, meta, backend)
        h = self.post_attention_layernorm(self._scaled(h), residual)
        return self._scaled(self.mlp(h)), residual

    def emit(self, p, first: bool) -> None:
        self.emit_normed_input(p, first)
        self.mixer.emit(p, H, H)
        if self.residual_scale is not None:
            p.scale(H, H, self.residual_scale)
        p.add_norm(H, H, self.post_attention_layernorm)
        self.mlp.emit(p, X, H)
        if self.residual_scale is not None:
            p.scale(X, X, self.residual_scale)

    def _scaled(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.residual_scale is None else x * self.residual_scale


class SandwichNormLayer(DecoderLayer):
    norm_names = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                  "post_feedforward_layernorm")

    def __init__(self, cfg, layer: int, tp: TensorParallel) -> None:
        super().__init__(cfg, layer, tp)
        self.input_layernorm = self.norm(cfg)
        self.post_attention_layernorm = self.norm(cfg)
        self.pre_feedforward_layernorm = self.norm(cfg)
        self.post_feedforward_layernorm = self.norm(cfg)

    def forward(self, x, residual, ropes, kv_cache, meta, backend) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.normed_input(x, residual)
        h = self.post_attention_layernorm(self.mixer(h, ropes, kv_cache, meta, backend))
        h = self.pre_feedforward_layernorm(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual

    def emit(self, p, first: bool) -> None:
        self.emit_normed_input(p, first)
        self.mixer.emit(p, H, H)
        p.norm(H, H, self.post_attention_layernorm)
        p.add_norm(H, H, self.pre_feedforward_layernorm)
        self.mlp.emit(p, X, H)
        p.norm(X, X, self.post_feedforward_layernorm)


class PostNormLayer(DecoderLayer):
    norm_names = ("post_attention_layernorm", "post_feedforward_layernorm")

    def __init__(self, cfg, layer: int, tp: TensorParallel) -> None:
        super().__init__(cfg, layer, tp)
        self.post_attention_layernorm = self.norm(cfg)
        self.post_feedforward_layernorm = self.norm(cfg)

    def forward(self, x, residual, ropes, kv_cache, meta, backend) -> tuple[torch.Tensor, torch.Tensor]:
        stream = x if residual is None else residual.add_(x)
        h = self.post_attention_layernorm(self.mixer(stream, ropes, kv_cache, meta, backend))
        stream.add_(h)
        return self.post_feedforward_layernorm(self.mlp(stream)), stream

    def emit(self, p, first: bool) -> None:
        p.set_residual(X) if first else p.add_residual(X)
        self.mixer.emit(p, H, R)
        p.norm(H, H, self.post_attention_layernorm)
        p.add_residual(H)
        self.mlp.emit(p, X, R)
        p.norm(X, X, self.post_feedforward_layernorm)
