"""One decoder for Llama, Mistral, Qwen2 and Qwen3: the families differ only in ModelConfig switches.

Module names mirror HF's, except that q/k/v and gate/up are fused into one matmul each
(qkv_proj, gate_up_proj; models/weights.py concatenates the checkpoint's tensors): fewer,
larger matmuls per layer. forward() takes a flat batch of tokens (no padding) plus the attention
backend and the metadata it built for this step, and knows nothing of requests or scheduling.
Platforms and weight formats plug in from outside (layers/dispatch.py): this file is the math.
Under tensor parallelism (distributed/parallel.py) the config is a rank's share (its heads and
intermediate features) and three places meet the other ranks: the sum after o_proj and after
down_proj, the vocab-parallel lookup, and the logits gathered over the vocabulary.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from twostep.attention.backend import AttentionBackend
from twostep.distributed.parallel import TensorParallel
from twostep.layers.activation import SiluAndMul
from twostep.layers.embedding import Embedding
from twostep.layers.linear import Linear
from twostep.layers.norm import RMSNorm
from twostep.layers.rotary import RopeTables, RotaryEmbedding
from twostep.models.config import ModelConfig


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, rope: RopeTables,
                kv_cache, meta, backend: AttentionBackend,
                ) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = rope.apply(self.q_norm(q), self.k_norm(k))
        else:       # q's and k's heads side by side in qkv: rotated in place, in one call
            rope.apply_(qkv[:, :self.q_size + self.kv_size].view(t, -1, self.head_dim))
        o = backend.forward(q, k, v, kv_cache, meta, self.scale)
        return self.tp.all_reduce(self.o_proj(o.reshape(t, self.num_heads * self.head_dim)))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.down_proj(self.act(self.gate_up_proj(x))))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, tp)

    def forward(self, x, residual, rope, kv_cache, meta, backend) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's output, residual: the stream before it (None at the first layer,
        where x is the embedding) -> (this layer's output, the stream before it). Each residual add
        is fused into the next norm, which updates residual in place."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h = self.input_layernorm(x, residual)
        h = self.self_attn(h, rope, kv_cache, meta, backend)
        h = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size // tp.world_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, tp) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DecoderForCausalLM(nn.Module):
    """embed -> N x [norm, attention, norm, MLP] -> norm; lm_head only where logits are needed."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel = TensorParallel()) -> None:
        super().__init__()
        self.config, self.tp = cfg, tp
        self.model = DecoderModel(cfg, tp)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size // tp.world_size, bias=False)
        self.rotary: RotaryEmbedding | None = None
        # fn(x, rope, kv_caches, meta, backend) -> (x, residual) running every layer of the steps it
        # takes in one platform call, None for the others (models/fused_decode.py); bound at load
        self.fused_decode: Callable | None = None

    def init_rotary(self, max_positions: int, device: torch.device) -> None:
        c = self.config
        self.rotary = RotaryEmbedding(c.head_dim, c.rope_theta, c.rope_scaling, max_positions, device,
                                      c.rope_freq_factors)

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            embedding = self.model.embed_tokens
            self.lm_head.weight, self.lm_head.quantized = embedding.weight, embedding.quantized

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list, meta,
                backend: AttentionBackend) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, hidden]."""
        return self.hidden_and_logits(input_ids, positions, kv_caches, meta, backend)[0]

    def hidden_and_logits(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list, meta,
                          backend: AttentionBackend, every_row: bool = False,
                          ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """forward's hidden states, and where every_row asks for all their logits and the decode
        stack takes the step with its lm_head, compute_logits of them from the stack's call (else None:
        the caller computes the logits of the rows it wants)."""
        if self.fused_decode is not None:
            fused = self.fused_decode(input_ids, positions, kv_caches, meta, backend, every_row)
            if fused is not None:
                return fused
        x = self.tp.embed(self.model.embed_tokens, input_ids, self.config.vocab_size)
        rope = self.rotary.lookup(positions, x.dtype)
        residual = None
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            x, residual = layer(x, residual, rope, kv_cache, meta, backend)
        return self.model.norm(x, residual), None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.tp.gather_last_dim(self.lm_head(hidden).float())
