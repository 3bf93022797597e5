"""The gated delta rule (Gated DeltaNet, Yang et al. 2024), the recurrence of Qwen3.5's and
Qwen3-Next's linear-attention layers, in float32. Per value head, a state S [Dk, Dv] and per token:

    S <- exp(g) S                     decay (g <= 0)
    u  = beta (v - S^T k)             the part of v the state does not predict yet (the delta rule)
    S <- S + k u^T                    written into the state
    o  = S^T q

q and k are L2-normalised per head and q scaled by Dk^-0.5 before (gated_deltanet.py).

- recurrent_step: one token of B sequences, the state updated in place (decode; PyTorch's answer
  where the platform has no kernel, and the reference the kernel is tested against).
- chunked: a prompt chunk of one sequence, parallel inside chunks of 64 tokens and recurrent across
  them (the WY form: within a chunk the u's solve one unit lower-triangular system), so a prompt
  costs matrix products instead of T dependent steps. Both give the same outputs and state up to
  float32 rounding.
"""
from __future__ import annotations

import torch

CHUNK = 64


def recurrent_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   state: torch.Tensor) -> torch.Tensor:
    """q, k [B, H, Dk], v [B, H, Dv], g, beta [B, H], state [B, H, Dk, Dv] (updated in place)
    -> o [B, H, Dv]; all float32."""
    state.mul_(g.exp()[..., None, None])
    predicted = torch.einsum("bhkv,bhk->bhv", state, k)
    u = (v - predicted) * beta[..., None]
    state.add_(k[..., :, None] * u[..., None, :])
    return torch.einsum("bhkv,bhk->bhv", state, q)


def chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            state: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """q, k [T, H, Dk], v [T, H, Dv], g, beta [T, H], state [H, Dk, Dv] (updated in place)
    -> o [T, H, Dv]; all float32."""
    t = q.shape[0]
    out = torch.empty(t, v.shape[1], v.shape[2], dtype=torch.float32, device=q.device)
    for s in range(0, t, chunk):
        e = min(s + chunk, t)
        out[s:e] = _chunk(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], state).transpose(0, 1)
    return out


def _chunk(q, k, v, g, beta, state) -> torch.Tensor:
    """One chunk of n tokens from state S0 (in place to the chunk's end); o [H, n, Dv]. With G the
    cumulative decay inside the chunk, the u's solve (I + A) U = beta V - beta exp(G) K S0, where
    A[t, j] = beta_t exp(G_t - G_j) k_t.k_j for j < t; then O = exp(G) Q S0 + (Q K^T * L) U with
    L[t, j] = exp(G_t - G_j) for j <= t, and S = exp(G_n) S0 + (exp(G_n - G) K)^T U."""
    q, k, v = (x.transpose(0, 1) for x in (q, k, v))          # [H, n, D]
    cum = g.transpose(0, 1).cumsum(-1)                        # [H, n]
    b = beta.transpose(0, 1)[..., None]                       # [H, n, 1]
    n = q.shape[1]
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    decay = (cum[:, :, None] - cum[:, None, :]).masked_fill(~causal, float("-inf")).exp()
    a = (b * (k @ k.transpose(-1, -2)) * decay).tril(-1)
    system = a + torch.eye(n, dtype=a.dtype, device=a.device)
    rhs = torch.cat([b * v, b * cum.exp()[..., None] * k], dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    u = solved[..., :v.shape[-1]] - solved[..., v.shape[-1]:] @ state
    out = (q * cum.exp()[..., None]) @ state + ((q @ k.transpose(-1, -2)) * decay) @ u
    last = cum[:, -1:]                                        # [H, 1]
    state.mul_(last.exp()[..., None]).add_((k * (last - cum).exp()[..., None]).transpose(-1, -2) @ u)
    return out
