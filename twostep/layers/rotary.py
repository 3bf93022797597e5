"""Rotary position embedding (non-interleaved halves, as in HF), with llama3 and linear scaling. The
ops "rotary" (to a new tensor) and "rotary_" (in place: the q and k heads of the qkv projection's
output in one call) may run as a platform kernel, bit-identical to these torch ops
(platforms/cpu/elementwise.py)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from twostep.layers.custom_op import CustomOp


@dataclass(slots=True, frozen=True)
class RopeScaling:
    rope_type: str                      # "llama3" or "linear"
    factor: float
    low_freq_factor: float = 1.0        # llama3 only
    high_freq_factor: float = 4.0       # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 only


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


def rotate_native(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated by cos/sin [T, 1, D]."""
    return x * cos + _rotate_half(x) * sin


def rotate_native_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """rotate_native written back into x (a view: the heads of a projection's output)."""
    x.copy_(rotate_native(x, cos, sin))


class RotaryEmbedding(CustomOp):
    """cos/sin for every position up to max_positions, looked up by each token's position."""

    native_ops = {"rotary": rotate_native, "rotary_": rotate_native_}

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling | None,
                 max_positions: int, device: torch.device,
                 freq_factors: tuple[float, ...] | None = None) -> None:
        super().__init__()
        inv_freq = inverse_frequencies(head_dim, theta, scaling)
        if freq_factors is not None:  # GGUF llama3 files store their scaling as these factors
            inv_freq = inv_freq / torch.tensor(freq_factors, dtype=torch.float32)
        inv_freq = inv_freq.to(device)
        t = torch.arange(max_positions, device=device, dtype=torch.int64).float()
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos()
        self.sin = emb.sin()
        self._tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeTables:
        """cos and sin for these positions, [T, 1, D]: computed once per step, used by every layer."""
        cos, sin = self.tables(dtype)
        return RopeTables(cos[positions], sin[positions], self.impls["rotary"], self.impls["rotary_"])

    def tables(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of every position in dtype, [max_positions, 1, D], made on first use: a step's
        lookup is then one index op each (the same values as rounding the looked-up float32 rows)."""
        if dtype not in self._tables:
            self._tables[dtype] = (self.cos.to(dtype).unsqueeze(1), self.sin.to(dtype).unsqueeze(1))
        return self._tables[dtype]


@dataclass(frozen=True, slots=True)
class RopeTables:
    """cos and sin [T, 1, D] of one step's positions, shared by every layer, and the rotation
    implementations picked at load (rotate_native / rotate_native_ or a platform's)."""

    cos: torch.Tensor
    sin: torch.Tensor
    rotate: Callable = rotate_native
    rotate_in_place: Callable = rotate_native_

    def apply(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotate(q, self.cos, self.sin), self.rotate(k, self.cos, self.sin)

    def apply_(self, heads: torch.Tensor) -> None:
        """Rotate heads [T, n, D] in place (any strides between tokens and heads)."""
        self.rotate_in_place(heads, self.cos, self.sin)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, H, D], k: [T, Hkv, D]; cos/sin: [T, 1, D] from RotaryEmbedding.lookup."""
    return rotate_native(q, cos, sin), rotate_native(k, cos, sin)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
