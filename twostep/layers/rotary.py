"""Rotary position embedding (non-interleaved halves, as in HF), with llama3 and linear scaling."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from twostep.models.config import RopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    return _llama3_scaled(inv_freq, scaling)


def _llama3_scaled(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding:
    """cos/sin for every position up to max_positions, looked up by each token's position."""

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling | None,
                 max_positions: int, device: torch.device,
                 freq_factors: tuple[float, ...] | None = None) -> None:
        inv_freq = inverse_frequencies(head_dim, theta, scaling)
        if freq_factors is not None:  # GGUF llama3 files store their scaling as these factors
            inv_freq = inv_freq / torch.tensor(freq_factors, dtype=torch.float32)
        inv_freq = inv_freq.to(device)
        t = torch.arange(max_positions, device=device, dtype=torch.int64).float()
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos()
        self.sin = emb.sin()
        self.kernel = None            # the elementwise C++ module, when the model runs on CPU

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeTables:
        """cos and sin for these positions, [T, 1, D]: computed once per step, used by every layer."""
        return RopeTables(self.cos[positions].unsqueeze(1).to(dtype),
                          self.sin[positions].unsqueeze(1).to(dtype), self.kernel)


@dataclass(frozen=True, slots=True)
class RopeTables:
    """cos and sin [T, 1, D] of one step's positions, shared by every layer; kernel: the elementwise
    C++ module (one call per tensor, bit-identical to apply_rotary) or None."""

    cos: torch.Tensor
    sin: torch.Tensor
    kernel: object = None

    def apply(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.kernel is None or q.dtype not in (torch.float32, torch.bfloat16):
            return apply_rotary(q, k, self.cos, self.sin)
        return self.kernel.rotary(q, self.cos, self.sin), self.kernel.rotary(k, self.cos, self.sin)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, H, D], k: [T, Hkv, D]; cos/sin: [T, 1, D] from RotaryEmbedding.lookup."""
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
