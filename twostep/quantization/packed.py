"""One compact weight layout for every quantized format twostep runs, and its reference math.

A matrix [n, k] is cut along k into blocks of 32 weights. Each weight is an integer code q of `bits`
bits (4, 5, 6 or 8) and reads back as `scale * (q - zero) + min`, with one scale (and min) per
`group` weights of a row (16, or a multiple of 32 up to k):

* bits 4-6: q is unsigned. A format without mins (Q4_0, Q5_0, Q6_K) centres its codes on
  zero = 2**(bits-1); one with mins (Q4_1, Q5_1, Q4_K, Q5_K, int4) has zero = 0 and a min per group.
* bits 8: q is a signed byte, zero = 0, no min (Q8_0, int8).

The codes are stored in planes, each [n, ...] row-major, so a row's blocks stream in order:

* `qs`: bits 4-6, 16 bytes per block: byte j holds weight j in its low nibble and weight j + 16 in
  its high one (GGUF's Q4_0 order, the order an AVX2 nibble split yields); bits 8: the 32 bytes.
* `qh`: the bits above the nibble. bits 5: 4 bytes per block, weight i's bit at byte i % 4, bit
  i // 4; bits 6: 8 bytes per block, weight i's two bits at byte i % 8, bits 2 (i // 8) and up.
  Each is what one broadcast and one variable shift per 32 or 64-bit lane unpacks.
* `scales`, `mins`: float16 [n, k / group].

The panel layout (`to_panels`) is the same planes regrouped for the CPU kernel's matrix-vector
product, which the CPU platform binds at load where it has that product (n a multiple of PANEL):
PANEL rows stored together, block by block, so the kernel reads eight rows' codes in one stream and
gets their eight sums in the eight lanes of a vector. A panel's block starts with 16-byte chunks c;
bytes 2j and 2j + 1 of a chunk belong to the panel's row j: bits 8: its codes 2c and 2c + 1; bits
4-6: the low nibbles of codes 4c and 4c + 1 in the low nibbles, of 4c + 2 and 4c + 3 in the high
ones. Bits 5 and 6 follow with the bits above the nibble in 16-byte vectors, one per P = 4 / w
chunks (w = bits - 4): vector c // P's byte 2j + u holds, at bit w (2 (c % P) + h), the w high bits
of row j's code 4c + 2h + u.
qs is [n / PANEL, k / 32, panel block bytes] (no qh plane), scales and mins [n / PANEL, k / group,
PANEL]. codes() and dequantize() read either layout; loading, slicing and stacking take the row
layout only.

GGUF's types map onto it by a reordering of their bits (models/gguf_loader.py ->
quantization/gguf_blocks.py); K-quants' 6 or 8-bit sub-block scales are multiplied out into one
float16 per group, which rounds them to float16 (a relative 2**-11, far inside the codes' own step).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

BLOCK = 32
PANEL = 8                 # rows of the panel layout


@dataclass(frozen=True, slots=True)
class PackedFormat:
    bits: int                 # 4, 5, 6 or 8
    group: int                # weights per scale: 16 or a multiple of 32
    has_min: bool
    name: str                 # where it came from: "Q4_K", "int8", ...

    def __post_init__(self) -> None:
        if self.bits not in (4, 5, 6, 8):
            raise ValueError(f"{self.name}: {self.bits}-bit codes are not supported")
        if self.group != 16 and (self.group <= 0 or self.group % BLOCK):
            raise ValueError(f"{self.name}: group size {self.group} is neither 16 nor a multiple of 32")
        if self.bits == 8 and self.has_min:
            raise ValueError(f"{self.name}: 8-bit codes are signed and take no min")

    @property
    def zero(self) -> int:
        return 0 if self.has_min or self.bits == 8 else 1 << (self.bits - 1)

    def bits_per_weight(self, k: int) -> float:
        group = min(self.group, k)
        return self.bits + 16 * (2 if self.has_min else 1) / group


@dataclass(frozen=True, slots=True)
class PackedWeight:
    """A quantized [n, k] matrix in the planes described above (tensors on the CPU)."""

    fmt: PackedFormat
    n: int
    k: int
    qs: torch.Tensor
    qh: torch.Tensor | None
    scales: torch.Tensor
    mins: torch.Tensor | None

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.k)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.planes() if t is not None)

    @property
    def panels(self) -> bool:
        """Whether the planes are in the panel layout (else row-major)."""
        return self.qs.dim() == 3

    def panel_layout_fits(self) -> bool:
        return self.n % PANEL == 0

    def to_panels(self) -> PackedWeight:
        """The panel layout (the reference; the CPU kernel's pack_panels does it at load)."""
        if self.panels or not self.panel_layout_fits():
            raise ValueError(f"{self.fmt.name} [{self.n}, {self.k}]: no panel layout for it")
        p, nb, codes = self.n // PANEL, self.k // BLOCK, self.codes().numpy().astype(np.uint8)
        if self.fmt.bits == 8:       # [p, j, nb, c, u] -> [p, nb, c, j, u]: code 2c + u of row j
            qs = codes.reshape(p, PANEL, nb, 16, 2).transpose(0, 2, 3, 1, 4).reshape(p, nb, -1)
        else:                        # code 4c + 2h + u of row j: [p, j, nb, c, h, u] -> [p, nb, c, j, h, u]
            c = codes.reshape(p, PANEL, nb, 8, 2, 2).transpose(0, 2, 3, 1, 4, 5)
            qs = ((c[..., 0, :] & 0xF) | ((c[..., 1, :] & 0xF) << 4)).reshape(p, nb, -1)
            if self.fmt.bits > 4:    # the bits above the nibble: [p, nb, vector, c % P, j, h, u] -> bytes
                w = self.fmt.bits - 4
                high = (c >> 4).reshape(p, nb, 2 * w, 4 // w, PANEL, 2, 2).astype(np.uint8)
                at = _high_bit_positions(w)
                vectors = np.bitwise_or.reduce(high << at, axis=(3, 5))          # [p, nb, vector, j, u]
                qs = np.concatenate([qs, vectors.reshape(p, nb, -1)], axis=-1)
        interleave = lambda t: None if t is None else t.reshape(p, PANEL, -1).transpose(1, 2).contiguous()  # noqa: E731
        qs = torch.from_numpy(np.ascontiguousarray(qs)).view(self.qs.dtype)
        return dataclasses.replace(self, qs=qs, qh=None, scales=interleave(self.scales), mins=interleave(self.mins))

    def row_layout(self) -> PackedWeight:
        """The row-major planes of a weight in either layout."""
        if not self.panels:
            return self
        p, nb = self.n // PANEL, self.k // BLOCK
        raw = self.qs.numpy().view(np.uint8)
        if self.fmt.bits == 8:       # [p, nb, c, j, u] -> [p, j, nb, c, u]
            codes = raw.reshape(p, nb, 16, PANEL, 2).transpose(0, 3, 1, 2, 4).reshape(self.n, self.k).view(np.int8)
        else:                        # [p, nb, c, j, h, u] -> [p, j, nb, c, h, u]
            b = raw[..., :16 * PANEL].reshape(p, nb, 8, PANEL, 1, 2)
            c = np.concatenate([b & 0xF, b >> 4], axis=4)
            if self.fmt.bits > 4:    # [p, nb, vector, j, u] -> [p, nb, vector, c % P, j, h, u]
                w = self.fmt.bits - 4
                vectors = raw[..., 16 * PANEL:].reshape(p, nb, 2 * w, 1, PANEL, 1, 2)
                at = _high_bit_positions(w)
                c |= (((vectors >> at) & ((1 << w) - 1)) << 4).reshape(c.shape)
            codes = c.transpose(0, 3, 1, 2, 4, 5).reshape(self.n, self.k)
        un = lambda t: None if t is None else t.transpose(1, 2).reshape(self.n, -1)  # noqa: E731
        mins = un(self.mins)
        return pack(np.ascontiguousarray(codes), un(self.scales).float().numpy(),
                    None if mins is None else mins.float().numpy(), self.fmt)

    def planes(self) -> tuple[torch.Tensor | None, ...]:
        return (self.qs, self.qh, self.scales, self.mins)

    def rows(self, index: torch.Tensor) -> PackedWeight:
        """Rows `index` (a row permutation or a gather), as a new matrix."""
        self._row_layout_only("row selection")
        picked = [None if t is None else t.index_select(0, index).contiguous() for t in self.planes()]
        return dataclasses.replace(self, n=int(index.numel()), qs=picked[0], qh=picked[1],
                                   scales=picked[2], mins=picked[3])

    def columns(self, start: int, end: int) -> PackedWeight:
        """Weights start..end of every row (a tensor-parallel rank's input slice), at whole blocks
        and whole groups; a scale per row (int8's) stays the row's scale."""
        self._row_layout_only("column slicing")
        per_row = self.fmt.group == self.k
        for edge in (start, end):
            if edge % BLOCK or (edge % self.fmt.group and not per_row):
                raise ValueError(f"{self.fmt.name}: cannot cut rows at weight {edge}: not a boundary of "
                                 f"its {BLOCK}-weight blocks and {self.fmt.group}-weight groups")
        blocks = self.k // BLOCK
        cut = lambda t: None if t is None else t[:, start // BLOCK * (t.shape[1] // blocks):  # noqa: E731
                                                 end // BLOCK * (t.shape[1] // blocks)].contiguous()
        if per_row:
            fmt, scales, mins = dataclasses.replace(self.fmt, group=end - start), self.scales, self.mins
        else:
            g = self.fmt.group
            fmt, scales = self.fmt, self.scales[:, start // g:end // g].contiguous()
            mins = None if self.mins is None else self.mins[:, start // g:end // g].contiguous()
        return dataclasses.replace(self, fmt=fmt, k=end - start, qs=cut(self.qs), qh=cut(self.qh),
                                   scales=scales, mins=mins)

    def _row_layout_only(self, what: str) -> None:
        if self.panels:
            raise ValueError(f"{what} takes the row layout (this {self.fmt.name} weight is in panels)")

    def codes(self) -> torch.Tensor:
        """The integer codes [n, k] (int16), unpacked from the planes."""
        if self.panels:
            return self.row_layout().codes()
        bits, n, k = self.fmt.bits, self.n, self.k
        if bits == 8:
            return self.qs.to(torch.int16)
        qs = self.qs.view(n, k // BLOCK, 16).to(torch.int16)
        codes = torch.cat([qs & 0xF, qs >> 4], dim=-1)
        if bits == 5:
            qh = self.qh.view(n, k // BLOCK, 1, 4).to(torch.int16)
            high = (qh >> torch.arange(8).view(1, 1, 8, 1)) & 1          # [.., i // 4, i % 4]
            codes = codes | (high.reshape(n, k // BLOCK, BLOCK) << 4)
        elif bits == 6:
            qh = self.qh.view(n, k // BLOCK, 1, 8).to(torch.int16)
            high = (qh >> (2 * torch.arange(4)).view(1, 1, 4, 1)) & 3    # [.., i // 8, i % 8]
            codes = codes | (high.reshape(n, k // BLOCK, BLOCK) << 4)
        return codes.reshape(n, k)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The reference: scale * (q - zero) + min in float32, then cast."""
        if self.panels:
            return self.row_layout().dequantize(dtype)
        group = self.fmt.group
        codes = (self.codes().float() - self.fmt.zero).view(self.n, self.k // group, group)
        w = codes * self.scales.float().unsqueeze(-1)
        if self.mins is not None:
            w = w + self.mins.float().unsqueeze(-1)
        return w.reshape(self.n, self.k).to(dtype)


def pack(codes: np.ndarray, scales: np.ndarray, mins: np.ndarray | None, fmt: PackedFormat) -> PackedWeight:
    """Planes from codes [n, k] (uint8 < 2**bits; int8 for 8 bits) and float scales/mins
    [n, k / group]."""
    n, k = codes.shape
    if k % BLOCK:
        raise ValueError(f"{fmt.name}: rows of {k} weights are not whole blocks of {BLOCK}")
    if k % fmt.group:
        raise ValueError(f"{fmt.name}: rows of {k} weights are not whole groups of {fmt.group}")
    if fmt.bits == 8:
        qs, qh = codes.astype(np.int8), None
    else:
        blocks = codes.astype(np.uint8).reshape(n, k // BLOCK, BLOCK)
        qs = (blocks[..., :16] & 0xF) | ((blocks[..., 16:] & 0xF) << 4)
        qh = _high_bits(blocks >> 4, fmt.bits)
    return PackedWeight(
        fmt, n, k,
        torch.from_numpy(np.ascontiguousarray(qs).reshape(n, -1)),
        None if qh is None else torch.from_numpy(qh.reshape(n, -1)),
        half_plane(scales, n, k // fmt.group),
        None if mins is None else half_plane(mins, n, k // fmt.group),
    )


def _high_bits(high: np.ndarray, bits: int) -> np.ndarray | None:
    """The bits above the nibble, [n, blocks, 32] -> the qh plane's bytes per block."""
    if bits == 4:
        return None
    n, nb, _ = high.shape
    if bits == 5:
        lanes = (high & 1).reshape(n, nb, 8, 4).astype(np.uint8)        # [.., i // 4, i % 4]
        shifts = np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
    else:
        lanes = (high & 3).reshape(n, nb, 4, 8).astype(np.uint8)        # [.., i // 8, i % 8]
        shifts = (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 4, 1)
    return np.bitwise_or.reduce(lanes << shifts, axis=2).astype(np.uint8)


def _high_bit_positions(w: int) -> np.ndarray:
    """Where the panel layout's high-bit bytes hold chunk c % P's half h: bit w (2 (c % P) + h),
    shaped [P, j, h, u] to broadcast against a vector's codes."""
    return (w * (2 * np.arange(4 // w).reshape(-1, 1, 1, 1) + np.arange(2).reshape(1, 1, 2, 1))).astype(np.uint8)


def half_plane(values: np.ndarray, n: int, groups: int) -> torch.Tensor:
    """Float scales (or mins) as the [n, groups] float16 plane."""
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32).reshape(n, groups).astype(np.float16))


def concat_rows(parts: list[PackedWeight]) -> PackedWeight:
    """Matrices of one format stacked along n (fused q/k/v, gate/up)."""
    first = parts[0]
    for part in parts:
        part._row_layout_only("stacking")
    planes = [None if p is None else torch.cat([part.planes()[i] for part in parts])
              for i, p in enumerate(first.planes())]
    return dataclasses.replace(first, n=sum(p.n for p in parts), qs=planes[0], qh=planes[1],
                               scales=planes[2], mins=planes[3])


@dataclass(frozen=True, slots=True)
class QuantizedWeight:
    """A linear's (or embedding's) weight [n, k] as packed matrices stacked along n: one part,
    or several where a fused projection's parts come in different formats (a Q4_K_M file's
    attn_v is Q6_K beside a Q4_K attn_q)."""

    parts: tuple[PackedWeight, ...]

    @staticmethod
    def stack(parts: list[PackedWeight | QuantizedWeight]) -> QuantizedWeight:
        flat = [p for part in parts for p in (part.parts if isinstance(part, QuantizedWeight) else (part,))]
        if len({p.k for p in flat}) != 1:
            raise ValueError("stacked quantized matrices must share their input size")
        merged: list[list[PackedWeight]] = []
        for part in flat:
            if merged and merged[-1][0].fmt == part.fmt:
                merged[-1].append(part)
            else:
                merged.append([part])
        return QuantizedWeight(tuple(group[0] if len(group) == 1 else concat_rows(group) for group in merged))

    def row_range(self, start: int, end: int) -> QuantizedWeight:
        """Rows start..end, wherever they fall among the parts (a tensor-parallel rank's share)."""
        out, offset = [], 0
        for part in self.parts:
            lo, hi = max(start - offset, 0), min(end - offset, part.n)
            if lo < hi:
                out.append(part.rows(torch.arange(lo, hi)))
            offset += part.n
        return QuantizedWeight(tuple(out))

    def columns(self, start: int, end: int) -> QuantizedWeight:
        return QuantizedWeight(tuple(p.columns(start, end) for p in self.parts))

    @property
    def n(self) -> int:
        return sum(p.n for p in self.parts)

    @property
    def k(self) -> int:
        return self.parts[0].k

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.k)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    @property
    def format_names(self) -> list[str]:
        return [p.fmt.name for p in self.parts]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.cat([p.dequantize(dtype) for p in self.parts])

    def rows(self, index: torch.Tensor) -> QuantizedWeight:
        """Rows `index` of a one-part weight (llama Q/K rows un-permuted at load)."""
        if len(self.parts) != 1:
            raise ValueError("row selection of a weight stacked from several formats")
        return QuantizedWeight((self.parts[0].rows(index),))
