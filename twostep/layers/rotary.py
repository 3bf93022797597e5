"""Rotary position embedding (non-interleaved halves, as in HF) over the whole head or its first
dims, with llama3, linear, YaRN, LongRoPE and dynamic NTK scaling. The
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
    """HF's rope_scaling (rope_parameters), the fields of every supported type."""

    rope_type: str                      # "llama3", "linear", "yarn", "longrope" or "dynamic"
    factor: float
    low_freq_factor: float = 1.0        # llama3
    high_freq_factor: float = 4.0       # llama3
    original_max_position_embeddings: int = 8192    # llama3, yarn, longrope
    max_position_embeddings: int = 8192     # the model's (dynamic: where scaling starts)
    attention_factor: float | None = None   # yarn, longrope: cos/sin times this (None: from factor)
    beta_fast: float = 32.0             # yarn
    beta_slow: float = 1.0              # yarn
    mscale: float | None = None         # yarn (DeepSeek's form of attention_factor)
    mscale_all_dim: float | None = None
    truncate: bool = True               # yarn
    short_factor: tuple[float, ...] | None = None   # longrope: per frequency, within the original context
    long_factor: tuple[float, ...] | None = None    # longrope: past it


def inverse_frequencies(dim: int, theta: float, scaling: RopeScaling | None,
                        max_positions: int = 0) -> tuple[torch.Tensor, float]:
    """The inverse frequencies of a rotary of `dim` dims, and the factor cos and sin are scaled by.
    max_positions: the longest context the engine runs, which picks LongRoPE's long factors (past
    the original context, as llama.cpp picks them for its context size) and dynamic NTK's base."""
    if scaling is not None and scaling.rope_type == "dynamic" and max_positions > scaling.max_position_embeddings:
        # HF rescales the base as a sequence grows past the model's context; here once, for the
        # longest context (identical to HF within the model's context)
        f = scaling.factor
        theta = theta * ((f * max_positions / scaling.max_position_embeddings) - (f - 1)) ** (dim / (dim - 2))
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if scaling is None or scaling.rope_type == "dynamic":
        return inv_freq, 1.0
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor, 1.0
    if scaling.rope_type == "yarn":
        return _yarn(dim, theta, scaling)
    if scaling.rope_type == "longrope":
        return _longrope(dim, theta, scaling, max_positions)
    return _llama3_scaled(inv_freq, scaling), 1.0


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


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(dim: int, theta: float, s: RopeScaling) -> tuple[torch.Tensor, float]:
    """YaRN: high frequencies kept, low ones interpolated by `factor`, a linear ramp between the
    dims that turn beta_fast and beta_slow times over the original context; cos/sin scaled up."""
    attention = s.attention_factor
    if attention is None:
        attention = (_yarn_mscale(s.factor, s.mscale) / _yarn_mscale(s.factor, s.mscale_all_dim)
                     if s.mscale and s.mscale_all_dim else _yarn_mscale(s.factor))

    def correction_dim(rotations: float) -> float:
        return dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (s.factor * freqs)) * (1 - extrapolation) + (1.0 / freqs) * extrapolation
    return inv_freq, float(attention)


def _longrope(dim: int, theta: float, s: RopeScaling, max_positions: int) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3/4): each frequency divided by its own factor, the short set within the
    original context, the long one past it; cos/sin scaled up as the context is stretched."""
    attention = s.attention_factor
    if attention is None:
        attention = 1.0 if s.factor <= 1.0 else math.sqrt(
            1 + math.log(s.factor) / math.log(s.original_max_position_embeddings))
    factors = s.long_factor if max_positions > s.original_max_position_embeddings else s.short_factor
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * theta ** shape), float(attention)


def rotate_native(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated by cos/sin [T, 1, D]."""
    return x * cos + _rotate_half(x) * sin


def rotate_native_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """rotate_native written back into x (a view: the heads of a projection's output)."""
    x.copy_(rotate_native(x, cos, sin))


class RotaryEmbedding(CustomOp):
    """cos/sin for every position up to max_positions, looked up by each token's position."""

    native_ops = {"rotary": rotate_native, "rotary_": rotate_native_}

    def __init__(self, dim: int, theta: float, scaling: RopeScaling | None,
                 max_positions: int, device: torch.device,
                 freq_factors: tuple[float, ...] | None = None) -> None:
        """dim: the rotated dims (the head's, or its first part under partial rotary)."""
        super().__init__()
        inv_freq, attention_factor = inverse_frequencies(dim, theta, scaling, max_positions)
        if freq_factors is not None:  # GGUF llama3 files store their scaling as these factors
            inv_freq = inv_freq / torch.tensor(freq_factors, dtype=torch.float32)
        inv_freq = inv_freq.to(device)
        t = torch.arange(max_positions, device=device, dtype=torch.int64).float()
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos() * attention_factor
        self.sin = emb.sin() * attention_factor
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
