"""The Gated DeltaNet block (Qwen3.5, Qwen3-Next): linear attention with a fixed-size state per
sequence in place of K/V (attention/linear_state.py holds it, kv/state_slots.py gives out its slots).

    q|k|v = in_proj_qkv(x) -> causal depthwise conv over the last `kernel` inputs -> SiLU
    q, k L2-normalised per head (q also times Dk^-0.5), each k head shared by Hv / Hk value heads
    g = -exp(A_log) softplus(in_proj_a(x) + dt_bias), beta = sigmoid(in_proj_b(x))
    o = the gated delta rule (layers/gated_delta_rule.py) from the sequence's state
    out_proj(RMSNorm(o) * w * SiLU(in_proj_z(x)))     per value head

A step's sequences run three ways (StateMetadata): decodes as one batched recurrent step (the
platform's kernel where it has one, which reads and writes the states in place), prompt chunks by
the chunked rule from their state (split where the prefix cache saves a state), and decodes that
verify drafts one token at a time, the state after each kept for the runner to pick the last
accepted one's. Tensor parallelism does not split these layers (refused at load).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from twostep.attention.linear_state import LinearStateCache, StateMetadata
from twostep.layers.gated_delta_rule import chunked, recurrent_step
from twostep.layers.linear import Linear

L2_EPS = 1e-6


class CausalConv1d(nn.Module):
    """A depthwise convolution's weight [channels, 1, kernel], as HF's nn.Conv1d holds it."""

    def __init__(self, channels: int, kernel: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel))

    def forward(self, xs: torch.Tensor) -> torch.Tensor:
        """xs [B, kernel - 1 + n, C] (the previous inputs, then n new ones) -> SiLU(conv) [B, n, C], float32."""
        w = self.weight.float().squeeze(1)                     # [C, K]
        kernel, n = w.shape[1], xs.shape[1] - w.shape[1] + 1
        xs = xs.float()
        y = xs[:, 0:n] * w[:, 0]
        for j in range(1, kernel):
            y = y + xs[:, j:j + n] * w[:, j]
        return F.silu(y)


class GatedRMSNorm(nn.Module):
    """RMSNorm over a value head, times w, times SiLU(z) (its weight is w itself, not 1 + w)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps

    def forward(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = z.dtype
        o = o.float()
        normed = (o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype)
        return (self.weight * normed * F.silu(z.float())).to(dtype)


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg, layer: int, tp) -> None:
        super().__init__()
        if tp.enabled:
            raise ValueError("linear-attention layers (Qwen3.5, Qwen3-Next) do not run under tensor parallelism yet")
        self.layer = layer
        self.num_k_heads, self.num_v_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.kernel = cfg.linear_conv_kernel
        h = cfg.hidden_size
        self.in_proj_qkv = Linear(h, 2 * self.key_dim + self.value_dim, bias=False)
        self.in_proj_z = Linear(h, self.value_dim, bias=False)
        self.in_proj_b = Linear(h, self.num_v_heads, bias=False)
        self.in_proj_a = Linear(h, self.num_v_heads, bias=False)
        self.conv1d = CausalConv1d(2 * self.key_dim + self.value_dim, self.kernel)
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads))
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, cfg.rms_norm_eps)
        self.out_proj = Linear(self.value_dim, h, bias=False)
        # the platform's one-call decode step (layers/dispatch.py), else PyTorch's
        self.decode_kernel: Callable | None = None

    def forward(self, x: torch.Tensor, ropes, cache: LinearStateCache, meta: StateMetadata, backend) -> torch.Tensor:
        mixed, z = self.in_proj_qkv(x), self.in_proj_z(x)
        a, b = self.in_proj_a(x), self.in_proj_b(x)
        out = torch.empty(x.shape[0], self.value_dim, dtype=x.dtype, device=x.device)
        if meta.decodes:
            index = meta.decode_rows
            if index is None:       # a decode batch: every row, in order
                out = self._decode(mixed, z, a, b, cache, meta.decode_slots)
            else:
                out[index] = self._decode(mixed[index], z[index], a[index], b[index], cache, meta.decode_slots)
        for i in meta.prompts:
            s, n = meta.query_start_loc[i], meta.query_lens[i]
            out[s:s + n] = self._prompt(mixed[s:s + n], z[s:s + n], a[s:s + n], b[s:s + n], cache,
                                        meta.slots[i], meta.saves.get(i, ()))
        for i in meta.verifies:
            s, n = meta.query_start_loc[i], meta.query_lens[i]
            out[s:s + n] = self._verify(i, mixed[s:s + n], z[s:s + n], a[s:s + n], b[s:s + n], cache, meta.slots[i])
        for i, saves in meta.saves.items():
            for after, slot in saves:
                if after == meta.query_lens[i]:      # the state at the step's end: what the live slot holds
                    cache.conv[slot].copy_(cache.conv[meta.slots[i]])
                    cache.recurrent[slot].copy_(cache.recurrent[meta.slots[i]])
        return self.out_proj(out)

    def emit(self, p, dst: int, src: int) -> None:
        """forward of a decode batch as one instruction of the decode program (models/fused_decode.py)."""
        p.linear_attention(dst, src, self)

    # ---- the three ways ----------------------------------------------------------------------

    def _decode(self, mixed, z, a, b, cache: LinearStateCache, slots: torch.Tensor) -> torch.Tensor:
        """One token of each sequence, its state updated in place: [B, value_dim]."""
        if self.decode_kernel is not None:
            return self.decode_kernel(mixed, z, a, b, cache.conv, cache.recurrent, slots, self.conv1d.weight.squeeze(1),
                                      self.A_log, self.dt_bias, self.norm.weight, self.norm.eps,
                                      self.num_k_heads, self.head_k_dim, self.head_v_dim)
        xs = torch.cat([cache.conv[slots], mixed[:, None, :]], dim=1)        # [B, K, C]
        q, k, v = self._heads(self.conv1d(xs)[:, 0])
        g, beta = self._gates(a, b)
        state = cache.recurrent[slots]
        o = recurrent_step(q, k, v, g, beta, state)
        cache.recurrent.index_copy_(0, slots, state)
        cache.conv.index_copy_(0, slots, xs[:, 1:].to(cache.conv.dtype))
        return self._output(o.to(z.dtype), z)

    def _prompt(self, mixed, z, a, b, cache: LinearStateCache, slot: int,
                saves: tuple[tuple[int, int], ...]) -> torch.Tensor:
        """A prompt chunk of one sequence by the chunked rule, from and into its state; where the
        prefix cache asks for the state after `after` of its tokens, it is copied into that slot
        (the chunk is cut there; a save at its end is forward's)."""
        n, keep = mixed.shape[0], self.kernel - 1
        xs = torch.cat([cache.conv[slot], mixed])                          # [K - 1 + n, C]
        q, k, v = self._heads(self.conv1d(xs[None])[0])
        g, beta = self._gates(a, b)
        state = cache.recurrent[slot]
        outs, done = [], 0
        for cut, save_slot in [*((after, s) for after, s in saves if after < n), (n, 0)]:
            outs.append(chunked(q[done:cut], k[done:cut], v[done:cut], g[done:cut], beta[done:cut], state))
            done = cut
            if save_slot:
                cache.recurrent[save_slot].copy_(state)
                cache.conv[save_slot].copy_(xs[cut:cut + keep])
        cache.conv[slot].copy_(xs[n:])
        return self._output(torch.cat(outs).to(z.dtype), z)

    def _verify(self, seq: int, mixed, z, a, b, cache: LinearStateCache, slot: int) -> torch.Tensor:
        """A decode and its drafts, a token at a time as decodes run, the state after each kept
        (cache.verified) for the runner to keep the last accepted token's."""
        slots = torch.tensor([slot], device=mixed.device)
        outs, convs, states = [], [], []
        for j in range(mixed.shape[0]):
            r = slice(j, j + 1)
            outs.append(self._decode(mixed[r], z[r], a[r], b[r], cache, slots))
            convs.append(cache.conv[slot].clone())
            states.append(cache.recurrent[slot].clone())
        cache.verified[seq] = (torch.stack(convs), torch.stack(states))
        return torch.cat(outs)

    # ---- shared pieces -----------------------------------------------------------------------

    def _heads(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The convolution's output [..., C] as q, k [..., Hv, Dk] (normalised, each k head repeated
        for its value heads) and v [..., Hv, Dv], float32."""
        q, k, v = y.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        lead = y.shape[:-1]
        q = q.reshape(*lead, self.num_k_heads, self.head_k_dim)
        k = k.reshape(*lead, self.num_k_heads, self.head_k_dim)
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + L2_EPS) * self.head_k_dim ** -0.5
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + L2_EPS)
        share = self.num_v_heads // self.num_k_heads
        if share > 1:
            q, k = q.repeat_interleave(share, dim=-2), k.repeat_interleave(share, dim=-2)
        return q, k, v.reshape(*lead, self.num_v_heads, self.head_v_dim)

    def _gates(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        return g, torch.sigmoid(b.float())

    def _output(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """The gated RMSNorm per value head: [..., Hv, Dv] -> [..., value_dim]."""
        lead = z.shape[:-1]
        normed = self.norm(o.reshape(*lead, self.num_v_heads, self.head_v_dim),
                           z.reshape(*lead, self.num_v_heads, self.head_v_dim))
        return normed.reshape(*lead, self.value_dim)

    def extra_repr(self) -> str:
        return (f"key_heads={self.num_k_heads}, value_heads={self.num_v_heads}, head_k_dim={self.head_k_dim}, "
                f"head_v_dim={self.head_v_dim}, kernel={self.kernel}")
