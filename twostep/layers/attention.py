"""The attention block every family's layer holds: the fused q/k/v projection, optional q/k
norms, rotary embedding over the whole head, part of it or none, the backend's attention with
this layer's options (scale, sliding window, soft-cap, sinks), and o_proj. Qwen3.5 and Qwen3-Next
gate the output: o times sigmoid(gate_proj(x)) before o_proj, the gate's rows fused after q/k/v.

Under tensor parallelism the config is a rank's share of the heads; the sum after o_proj meets
the other ranks. A norm over all heads (OLMo 2) would need the other ranks' heads and is refused."""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from twostep.attention.backend import AttentionBackend
from twostep.attention.options import AttentionOptions
from twostep.distributed.parallel import TensorParallel
from twostep.layers.linear import Linear
from twostep.layers.norm import RMSNorm
from twostep.layers.rotary import RopeTables


class Attention(nn.Module):
    def __init__(self, cfg, layer: int, tp: TensorParallel) -> None:
        super().__init__()
        self.tp, self.layer = tp, layer
        self.kv_group = cfg.kv_group(layer)            # whose block tables its cache takes
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.rotary_dim = cfg.rotary_dim or cfg.head_dim
        self.rope_kind = cfg.rope_kind(layer)          # which of the step's rotary tables (None: NoPE)
        self.options = AttentionOptions(cfg.scale, cfg.window(layer), cfg.attn_softcap)
        # gpt-oss: a learned logit per head; the options take it once loaded (loaded())
        self.sinks = nn.Parameter(torch.empty(cfg.num_heads)) if cfg.attn_sinks else None
        self.gate_size = self.q_size if cfg.attn_output_gate else 0
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size + self.gate_size, bias=cfg.qkv_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm == "full" and tp.enabled:
            raise ValueError("q/k norms over all heads (OLMo 2) do not run under tensor parallelism")
        q_dim, k_dim = (self.q_size, self.kv_size) if cfg.qk_norm == "full" else (cfg.head_dim, cfg.head_dim)
        self.q_norm = RMSNorm(q_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(k_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, ropes: dict[str, RopeTables], kv_cache, meta,
                backend: AttentionBackend) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        q, k, v, gate = qkv.split([self.q_size, self.kv_size, self.kv_size, self.gate_size], dim=-1)
        rope = None if self.rope_kind is None else ropes[self.rope_kind]
        partial = self.rotary_dim < self.head_dim
        if self.qk_norm == "full":
            q = self.q_norm(q).view(t, self.num_heads, self.head_dim)
            k = self.k_norm(k).view(t, self.num_kv_heads, self.head_dim)
            _rotate_in_place(rope, (q, k), self.rotary_dim)
        elif self.qk_norm == "head":
            q = self.q_norm(q.view(t, self.num_heads, self.head_dim))
            k = self.k_norm(k.view(t, self.num_kv_heads, self.head_dim))
            if rope is not None and not partial:
                q, k = rope.apply(q, k)
            else:
                _rotate_in_place(rope, (q, k), self.rotary_dim)
        else:       # q's and k's heads side by side in qkv: rotated in place, in one call
            q = q.view(t, self.num_heads, self.head_dim)
            k = k.view(t, self.num_kv_heads, self.head_dim)
            _rotate_in_place(rope, (qkv[:, :self.q_size + self.kv_size].view(t, -1, self.head_dim),),
                             self.rotary_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        o = backend.forward(q, k, v, kv_cache, meta, self.options).reshape(t, self.q_size)
        if self.gate_size:
            o = o * torch.sigmoid(gate)
        return self.tp.all_reduce(self.o_proj(o))

    def loaded(self) -> None:
        """After the checkpoint's tensors are in: the options take the sinks as loaded."""
        if self.sinks is not None:
            self.options = dataclasses.replace(self.options, sinks=self.sinks)

    def emit(self, p, dst: int, src: int) -> None:
        """forward as one instruction of the decode program (models/fused_decode.py)."""
        p.attention(dst, src, self)


def _rotate_in_place(rope: RopeTables | None, heads: tuple[torch.Tensor, ...], rotary_dim: int) -> None:
    """Rotate the first rotary_dim dims of each [T, n, D] view in place (none without RoPE)."""
    if rope is None:
        return
    for h in heads:
        rope.apply_(h if h.shape[-1] == rotary_dim else h[..., :rotary_dim])
