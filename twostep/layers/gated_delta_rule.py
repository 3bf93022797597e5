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
import torch.nn.functional as F

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
    -> o [T, H, Dv]; all float32.

    Per chunk of n tokens from the state S0 at its start, with G the cumulative decay inside it: the
    u's solve (I + A) U = beta V - beta exp(G) K S0, where A[t, j] = beta_t exp(G_t - G_j) k_t.k_j for
    j < t; then O = exp(G) Q S0 + (Q K^T * L) U with L[t, j] = exp(G_t - G_j) for j <= t, and the
    state after it exp(G_n) S0 + (exp(G_n - G) K)^T U. Everything but S0 is known for every chunk at
    once, so only the products with the state run chunk after chunk. The last chunk is padded with
    tokens of beta = 0 and g = 0, which change nothing."""
    t, heads, dv = q.shape[0], q.shape[1], v.shape[2]
    n = min(chunk, t)
    pad = -t % n
    q, k, v, g, beta = (F.pad(x.transpose(0, 1), (0, 0, 0, pad)) if x.dim() == 3
                        else F.pad(x.transpose(0, 1), (0, pad)) for x in (q, k, v, g, beta))
    q, k, v = (x.reshape(heads, -1, n, x.shape[-1]) for x in (q, k, v))        # [H, N, n, D]
    cum = g.reshape(heads, -1, n).cumsum(-1)                                     # [H, N, n]
    b = beta.reshape(heads, -1, n)[..., None]
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    system = (b * (k @ k.transpose(-1, -2)) * decay).tril(-1) + torch.eye(n, dtype=q.dtype, device=q.device)
    rhs = torch.cat([b * v, b * cum.exp()[..., None] * k], dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    values, keys = solved[..., :dv], solved[..., dv:]                            # U = values - keys @ S0
    q_decayed = q * cum.exp()[..., None]
    scores = (q @ k.transpose(-1, -2)) * decay
    last = cum[..., -1:]                                                         # [H, N, 1]
    k_to_end = (k * (last - cum).exp()[..., None]).transpose(-1, -2)             # [H, N, Dk, n]
    through = last.exp()[..., None]                                              # [H, N, 1, 1]
    out = torch.empty(heads, q.shape[1], n, dv, dtype=torch.float32, device=q.device)
    for c in range(q.shape[1]):
        u = values[:, c] - keys[:, c] @ state
        out[:, c] = q_decayed[:, c] @ state + scores[:, c] @ u
        state.mul_(through[:, c]).add_(k_to_end[:, c] @ u)
    return out.reshape(heads, -1, dv)[:, :t].transpose(0, 1)
