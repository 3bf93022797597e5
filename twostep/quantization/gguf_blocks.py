"""GGUF's quantized block types, rearranged into twostep's packed layout (quantization/packed.py).

The planes are cut from the blocks' bit fields (byte operations over whole tensors: no code is
decoded on its own); each type's decoder, which returns the integer codes in weight order plus one
scale (and min) per group for `pack` to lay out, is the reference the tests hold them to
(decode_and_pack). No weight is dequantized: the codes are GGUF's own, and so are the scales, except
that K-quants' super-block scale times sub-block scale is rounded to float16 (see packed.py). The
layouts follow ggml-quants.c (and gguf.quants, the reference the tests compare against).

MXFP4 (GGUF's, and gpt-oss's own safetensors checkpoints: pack_mxfp4) is kept losslessly too, its
e2m1 codes mapped onto 5-bit linear codes with a power-of-two float16 scale per block: 5.5 bits a
weight resident against the file's 4.25 (see the MXFP4 notes below).
"""
from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as QType
from gguf import GGML_QUANT_SIZES

from twostep.quantization.packed import BLOCK, PackedFormat, PackedWeight, half_plane, pack

QK_K = 256


def _f16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


def _nibbles32(qs: np.ndarray) -> np.ndarray:
    """16 bytes per block of 32 -> codes 0..15: low nibbles are weights 0-15, high ones 16-31."""
    return np.concatenate([qs & 0xF, qs >> 4], axis=-1)


def _bits32(qh: np.ndarray) -> np.ndarray:
    """4 bytes per block, little-endian: bit i is weight i's fifth bit."""
    words = np.ascontiguousarray(qh).view("<u4")
    return ((words >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


def _q8_0(b):
    return b[:, 2:].view(np.int8), _f16(b[:, :2]), None


def _q4_0(b):
    return _nibbles32(b[:, 2:]), _f16(b[:, :2]), None


def _q4_1(b):
    return _nibbles32(b[:, 4:]), _f16(b[:, :2]), _f16(b[:, 2:4])


def _q5_0(b):
    return _nibbles32(b[:, 6:]) | (_bits32(b[:, 2:6]) << 4), _f16(b[:, :2]), None


def _q5_1(b):
    return _nibbles32(b[:, 8:]) | (_bits32(b[:, 4:8]) << 4), _f16(b[:, :2]), _f16(b[:, 2:4])


def _k_scales_mins(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: 12 bytes -> 8 six-bit sub-block scales and 8 six-bit mins."""
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _k_low_nibbles(qs: np.ndarray) -> np.ndarray:
    """128 bytes -> 256 codes: each 32 bytes carry two sub-blocks, low nibbles first."""
    q = qs.reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (q & 0xF).reshape(-1, QK_K)


def _k_scales(b):
    """Q4_K / Q5_K: each sub-block's scale (super-block scale x its 6-bit scale) and min (negated)."""
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, mn = _k_scales_mins(b[:, 4:16])
    return d * sc, -(dmin * mn)


def _q4_k(b):
    return _k_low_nibbles(b[:, 16:]), *_k_scales(b)


def _q5_k(b):
    qh = b[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    codes = _k_low_nibbles(b[:, 48:]) | ((qh & 1).reshape(-1, QK_K) << 4)
    return codes, *_k_scales(b)


def _q6_k(b):
    ql = b[:, :128].reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    qh = b[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    codes = (ql & 0xF).reshape(-1, QK_K) | ((qh & 3).reshape(-1, QK_K) << 4)
    return codes, _q6_k_scales(b), None


def _q6_k_scales(b):
    """Q6_K: each sub-block of 16's scale (super-block scale x its int8 scale)."""
    return _f16(b[:, 208:210]) * b[:, 192:208].view(np.int8).astype(np.float32)


# MXFP4 (OCP microscaling; ggml-quants.c, gguf.quants.MXFP4): a block of 32 is one e8m0 exponent byte e
# and 16 bytes of 4-bit e2m1 codes, byte j holding weight j in its low nibble and weight j + 16 in its
# high one (Q4_0's order). ggml reads a code c as kvalues_mxfp4[c], the e2m1 value doubled:
_MXFP4_DOUBLED = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.int8)
# times e8m0_to_fp32_half(e) = 2**(e - 128) for every e (e < 2: float32 subnormals; no NaN at 255).
# A weight is thus 2**(e - 128) * kvalue: twostep keeps it as the 5-bit code q = kvalue + 16 (4..28,
# zero 16, no min) and the scale 2**(e - 128), which float16 holds exactly for e - 128 in -24..15.
# Resident that is 5.5 bits a weight against the file's 4.25: the kernels read linear codes only (no
# non-linear 4-bit codebook yet), and e2m1's values doubled need 5 bits as integers.
_MXFP4_ZERO = 16
_MXFP4_EXPONENTS = (128 - 24, 128 + 15)          # e8m0 bytes whose scale float16 holds exactly


def _mxfp4_scales(exponents: np.ndarray, nonzero: np.ndarray, name: str = "MXFP4") -> np.ndarray:
    """Per block, 2**(e - 128) (float32, exact); 0 for a block of zero codes whose scale float16 cannot
    hold. A block with a nonzero code and such a scale is refused (ValueError)."""
    e = np.asarray(exponents, dtype=np.uint8).reshape(-1)
    lo, hi = _MXFP4_EXPONENTS
    fits = (e >= lo) & (e <= hi)
    bad = ~fits & np.asarray(nonzero, dtype=bool).reshape(-1)
    if bad.any():
        first = int(np.flatnonzero(bad)[0])
        raise ValueError(f"{name}: {int(bad.sum())} block(s) have a scale float16 cannot hold exactly (block "
                         f"{first}: e8m0 exponent {int(e[first])}, scale 2**{int(e[first]) - 128}); twostep keeps "
                         f"{name} scales 2**-24 .. 2**15 (exponent bytes {lo}..{hi}) only")
    return np.where(fits, np.ldexp(np.float32(1), e.astype(np.int32) - 128), np.float32(0)).astype(np.float32)


def _mxfp4(b):
    """The reference decoder: codes kvalue + 16 in weight order, one scale per block."""
    codes = (_MXFP4_DOUBLED[_nibbles32(b[:, 1:])] + _MXFP4_ZERO).astype(np.uint8)
    return codes, _mxfp4_scales(b[:, 0], (codes != _MXFP4_ZERO).any(axis=-1)), None


def _mxfp4_tables() -> tuple[np.ndarray, np.ndarray]:
    """Per code byte (low nibble weight i, high nibble weight i + 16): the qs plane's byte (the codes'
    low nibbles, in the same places) and the codes' fifth bits at bits 0 and 4."""
    byte = np.arange(256)
    low, high = (_MXFP4_DOUBLED[byte & 0xF] + _MXFP4_ZERO), (_MXFP4_DOUBLED[byte >> 4] + _MXFP4_ZERO)
    qs = ((low & 0xF) | ((high & 0xF) << 4)).astype(np.uint8)
    fifth = ((low >> 4) | ((high >> 4) << 4)).astype(np.uint8)
    return qs, fifth


_MXFP4_QS, _MXFP4_FIFTH = _mxfp4_tables()


def _mxfp4_weight(codes: np.ndarray, exponents: np.ndarray, n: int, k: int, name: str = "MXFP4") -> PackedWeight:
    """MXFP4 blocks, code bytes [blocks, 16] in GGUF's nibble order and e8m0 exponents [blocks], as the
    planes (field-wise, by byte tables: no code is decoded on its own)."""
    codes = np.ascontiguousarray(codes, dtype=np.uint8).reshape(-1, 16)
    halves = codes.view("<u8")                     # a code other than +-0: a magnitude bit set
    nonzero = ((halves[:, 0] | halves[:, 1]) & np.uint64(0x7777777777777777)) != 0
    scales = _mxfp4_scales(exponents, nonzero, name)
    # qh byte b, bit t: the fifth bit of weight 4 t + b. Code byte 4 t' + b holds weights 4 t' + b and
    # 4 (t' + 4) + b, their fifth bits at bits 0 and 4 of its table entry: word t' of the entries
    # (bytes b = 0..3) shifted by t' puts them at bits t' and t' + 4 of byte b
    words = _MXFP4_FIFTH[codes].view("<u4")                                   # [.., t']
    qh = (words[:, 0] | (words[:, 1] << 1) | (words[:, 2] << 2) | (words[:, 3] << 3)).view(np.uint8)
    return PackedWeight(PackedFormat(5, BLOCK, False, name), n, k, _plane(_MXFP4_QS[codes], n), _plane(qh, n),
                        half_plane(scales, n, k // BLOCK), None)


def pack_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> PackedWeight:
    """A matrix [n, k] in gpt-oss's safetensors MXFP4 (`*_blocks` uint8 [n, k / 32, 16], `*_scales`
    uint8 [n, k / 32]; an expert's slice of the [experts, n, k / 32, ...] tensors) as a PackedWeight,
    losslessly. Its codes and exponents are GGUF's MXFP4 (e2m1 codes, e8m0 exponents: transformers'
    integrations/mxfp4.py reads FP4_VALUES[c] * 2**(e - 127), which is ggml's kvalue * 2**(e - 128)),
    but byte j of a block holds weights 2j (low nibble) and 2j + 1 (high), where GGUF's holds j and
    j + 16: the nibbles are regrouped into GGUF's order, then packed as pack_gguf packs MXFP4 (5-bit
    codes, 5.5 bits a weight resident; ValueError for a scale float16 cannot hold, as there)."""
    blocks, scales = np.asarray(blocks), np.asarray(scales)
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8 (got {blocks.dtype}, {scales.dtype})")
    if blocks.ndim != 3 or blocks.shape[-1] != 16 or scales.shape != blocks.shape[:2]:
        raise ValueError(f"MXFP4 blocks [n, k / 32, 16] and scales [n, k / 32] expected, got "
                         f"{list(blocks.shape)} and {list(scales.shape)}")
    n, nb, _ = blocks.shape
    # GGUF's byte 2m + h holds weights 2m + h and 2m + h + 16: nibble h of bytes m and 8 + m here
    first, second = blocks.reshape(-1, 16)[:, :8], blocks.reshape(-1, 16)[:, 8:]
    codes = np.empty((n * nb, 8, 2), dtype=np.uint8)
    codes[..., 0] = (first & 0xF) | (second << 4)
    codes[..., 1] = (first >> 4) | (second & 0xF0)
    return _mxfp4_weight(codes, scales, n, nb * BLOCK)


# type -> (decoder, bits, weights per scale, has mins)
_DECODERS = {
    QType.Q8_0: (_q8_0, 8, 32, False),
    QType.Q4_0: (_q4_0, 4, 32, False),
    QType.Q4_1: (_q4_1, 4, 32, True),
    QType.Q5_0: (_q5_0, 5, 32, False),
    QType.Q5_1: (_q5_1, 5, 32, True),
    QType.Q4_K: (_q4_k, 4, 32, True),
    QType.Q5_K: (_q5_k, 5, 32, True),
    QType.Q6_K: (_q6_k, 6, 16, False),
    QType.MXFP4: (_mxfp4, 5, 32, False),
}
PACKED_TYPES = tuple(_DECODERS)


def gguf_bits_per_weight(qtype: QType) -> float:
    """What a weight of this type costs in the file: Q4_0 4.5, Q4_K 4.5, Q6_K 6.5625, Q8_0 8.5."""
    block, size = GGML_QUANT_SIZES[qtype]
    return 8 * size / block


def held_bytes(qtype: QType, ggml_shape: list[int], file_bytes: int) -> float:
    """The bytes a tensor takes once loaded: packed matrices in twostep's layout, the rest as stored."""
    if qtype not in _DECODERS or len(ggml_shape) != 2:
        return file_bytes
    _, bits, group, has_min = _DECODERS[qtype]
    k, n = ggml_shape
    return n * k * PackedFormat(bits, group, has_min, qtype.name).bits_per_weight(k) / 8


def pack_gguf(raw: np.ndarray, qtype: QType, n: int, k: int) -> PackedWeight:
    """A GGUF tensor's bytes (rows of blocks) as a PackedWeight [n, k]."""
    _, bits, group, has_min = _DECODERS[qtype]
    block, size = GGML_QUANT_SIZES[qtype]
    if k % block:
        raise ValueError(f"{qtype.name} rows of {k} weights are not whole blocks of {block}")
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1, size)
    if blocks.shape[0] != n * k // block:
        raise ValueError(f"{qtype.name} tensor [{n}, {k}] has {blocks.shape[0]} blocks, "
                         f"expected {n * k // block}")
    fmt = PackedFormat(bits, group, has_min, qtype.name)
    if qtype in _SAME_LAYOUT:
        return _split_fields(blocks, qtype, fmt, n, k)
    if qtype == QType.MXFP4:
        return _mxfp4_weight(blocks[:, 1:], blocks[:, 0], n, k)
    if qtype in _K_PLANES:
        qs, qh, scales, mins = _K_PLANES[qtype](blocks)
        return PackedWeight(fmt, n, k, _plane(qs, n), None if qh is None else _plane(qh, n),
                            half_plane(scales, n, k // group), None if mins is None else half_plane(mins, n, k // group))
    return decode_and_pack(blocks, qtype, n, k)


def decode_and_pack(blocks: np.ndarray, qtype: QType, n: int, k: int) -> PackedWeight:
    """Every code decoded, then packed into the planes: the reference for pack_gguf's planes (and
    its way for a type with no field-wise planes)."""
    decoder, bits, group, has_min = _DECODERS[qtype]
    codes, scales, mins = decoder(blocks)
    return pack(codes.reshape(n, k), scales.reshape(n, -1), None if mins is None else mins.reshape(n, -1),
                PackedFormat(bits, group, has_min, qtype.name))


# Types whose block is [fp16 scale, (fp16 min,) (32 fifth bits,) codes] with the codes as the packed
# qs plane holds them (8-bit: signed bytes; 4-bit nibbles: byte i = weight i | weight i + 16 << 4):
# their planes are the blocks' fields copied out, the fifth bits regrouped (_fifth_bits), with no
# decode and re-pack (the default file's 211 tensors: 0.32 -> 0.05 s; the Qwen-shape Q4_K_M file's,
# mostly Q5_0 where rows of 896 are not whole K-quant blocks: 6.3 -> 1.5-1.8 s on a Zen 1, 0.9-1.2 s
# with the K-quants' planes below).
_SAME_LAYOUT = {QType.Q8_0: (2, None), QType.Q4_0: (2, None), QType.Q4_1: (4, None),   # type -> offsets
                QType.Q5_0: (6, 2), QType.Q5_1: (8, 4)}                                # of codes, fifth bits


def _plane(a: np.ndarray, n: int) -> torch.Tensor:
    """A plane's bytes (or float16 values), block after block, as its [n, ...] tensor."""
    return torch.from_numpy(np.ascontiguousarray(a).reshape(n, -1))


def _split_fields(blocks: np.ndarray, qtype: QType, fmt: PackedFormat, n: int, k: int) -> PackedWeight:
    codes_at, high_at = _SAME_LAYOUT[qtype]
    qs = blocks[:, codes_at:].view(np.int8) if fmt.bits == 8 else blocks[:, codes_at:]
    qh = None if high_at is None else _plane(_fifth_bits(blocks[:, high_at:high_at + 4]), n)
    return PackedWeight(fmt, n, k, _plane(qs, n), qh, _plane(blocks[:, :2].view(np.float16), n),
                        _plane(blocks[:, 2:4].view(np.float16), n) if fmt.has_min else None)


# The K-quants' planes straight from their bit fields, 16 or 32 codes a byte operation (decoding each
# code and packing them, decode_and_pack, is 1.8-2.3x slower: Q4_K 5.3 ns a weight, Q5_K 20.5, Q6_K
# 15.1, on a Zen 1).
# Each returns (qs plane bytes, qh plane bytes, scales, mins) per super-block of 256 weights; the
# qs plane's byte i of a block of 32 is code i | code i + 16 << 4 (its low nibbles).

def _nibble_pairs(low: np.ndarray) -> np.ndarray:
    """[..., 32] low nibbles of a block's codes -> its 16 qs bytes."""
    return low[..., :16] | (low[..., 16:] << 4)


def _k4_nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_K / Q5_K: 128 bytes, each 32 carrying sub-blocks 2c (low nibbles) and 2c + 1 (high)."""
    q = qs.reshape(-1, 4, 1, 32)
    return _nibble_pairs(np.concatenate([q & 0xF, q >> 4], axis=2))          # [.., c, sub-block, 16]


def _q4_k_planes(b):
    return _k4_nibbles(b[:, 16:]), None, *_k_scales(b)


def _q5_k_planes(b):
    # fifth bit of sub-block s's weight i: bit s of byte i; the qh plane: byte i % 4, bit i // 4
    qh = b[:, 16:48].reshape(-1, 1, 8, 4) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1, 1)   # [.., s, t, i % 4]
    high = np.packbits((qh & 1).transpose(0, 1, 3, 2), axis=-1, bitorder="little")
    return _k4_nibbles(b[:, 48:]), high, *_k_scales(b)


def _q6_k_planes(b):
    # weight 128 h + 64 s + m: low nibble (ql[64 h + m] >> 4 s); weight 128 h + 32 r + i: high bits
    # (qh[32 h + i] >> 2 r) & 3. Block r of half h is s = r // 2, m = 32 (r % 2) + i.
    ql = b[:, :128].reshape(-1, 2, 1, 2, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1, 1)
    codes = _nibble_pairs(ql & 0xF)                                         # [.., h, s, r % 2, 16]
    # the qh plane: byte j, bits 2 t of block r = the high bits of weight j + 8 t
    qh = b[:, 128:192].reshape(-1, 2, 1, 4, 8) >> (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 4, 1, 1)
    v = qh & 3                                                              # [.., h, r, t, j]
    high = v[:, :, :, 0] | (v[:, :, :, 1] << 2) | (v[:, :, :, 2] << 4) | (v[:, :, :, 3] << 6)
    return codes, high, _q6_k_scales(b), None


_K_PLANES = {QType.Q4_K: _q4_k_planes, QType.Q5_K: _q5_k_planes, QType.Q6_K: _q6_k_planes}


def _fifth_bits(words: np.ndarray) -> np.ndarray:
    """GGUF's fifth bits, bit i of a block's little-endian 32-bit word for weight i, as the qh plane
    holds them: byte i % 4, bit i // 4 (packed.py). Byte b gathers bits b, b + 4, ..., b + 28 of the
    word, moved together in three steps of shifts and masks."""
    w = np.ascontiguousarray(words).view("<u4").reshape(-1)
    out = np.empty((w.size, 4), dtype=np.uint8)
    for b in range(4):
        x = (w >> b) & 0x11111111                 # bits 4t
        x = (x | (x >> 3)) & 0x03030303           # pairs at 8s, 8s + 1
        x = (x | (x >> 6)) & 0x000F000F           # nibbles at 0 and 16
        out[:, b] = ((x | (x >> 12)) & 0xFF).astype(np.uint8)
    return out
