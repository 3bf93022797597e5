"""MXFP4 (GGUF's type 39 and gpt-oss's safetensors blocks/scales) in the packed layout: losslessly,
bit for bit against gguf.quants' and transformers' own dequantizers, and refused with a clear error
where a block's power-of-two scale is outside what float16 holds exactly."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType

from twostep.quantization.gguf_blocks import PACKED_TYPES, decode_and_pack, held_bytes, pack_gguf, pack_mxfp4

MXFP4 = QType.MXFP4
BLOCK, SIZE = gguf.GGML_QUANT_SIZES[MXFP4]
LOWEST, HIGHEST = 104, 143           # e8m0 bytes of the scales 2**-24 .. 2**15 (2**(e - 128))
SHAPES = [(1, 32), (8, 64), (37, 96), (16, 18 * 32), (24, 2880)]


def quantized_blocks(n: int, k: int, seed: int, spread: float = 1.0) -> np.ndarray:
    """gguf-py's own MXFP4 quantization of random weights, rows of blocks [n, k / 32 * 17]; `spread`
    varies the rows' magnitudes (powers of two apart) so many exponents occur."""
    rng = np.random.default_rng(seed)
    magnitude = 2.0 ** rng.uniform(-8 * spread, 4 * spread, (n, 1))
    w = (rng.standard_normal((n, k)) * magnitude).astype(np.float32)
    return gguf.quants.quantize(w, MXFP4).reshape(n, -1)


def random_blocks(n: int, k: int, seed: int, lo: int = LOWEST, hi: int = HIGHEST) -> np.ndarray:
    """Random code bytes (every nibble, -0 included) with exponents lo..hi."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n * k // BLOCK, SIZE), dtype=np.uint8)
    raw[:, 0] = rng.integers(lo, hi + 1, raw.shape[0])
    return raw.reshape(n, -1)


def gguf_dequantized(raw: np.ndarray, n: int, k: int) -> torch.Tensor:
    return torch.from_numpy(np.array(gguf.quants.dequantize(raw, MXFP4), dtype=np.float32)).reshape(n, k)


def gguf_to_hf(raw: np.ndarray, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """GGUF blocks as gpt-oss's checkpoint holds them: weight 2j in byte j's low nibble, 2j + 1 in its
    high one (GGUF: weight j low, j + 16 high), the exponents apart."""
    blocks = raw.reshape(n, k // BLOCK, SIZE)
    nibbles = blocks[..., 1:]
    weights = np.concatenate([nibbles & 0xF, nibbles >> 4], axis=-1)          # weight order
    hf = weights[..., 0::2] | (weights[..., 1::2] << 4)
    return np.ascontiguousarray(hf), np.ascontiguousarray(blocks[..., 0])


def test_mxfp4_is_a_packed_type():
    assert MXFP4 in PACKED_TYPES and MXFP4.value == 39 and (BLOCK, SIZE) == (32, 17)
    # held as 5-bit codes and a float16 scale per 32: 5.5 bits a weight (the file: 4.25)
    assert held_bytes(MXFP4, [2880, 64], 64 * 2880 * 17 // 32) == 64 * 2880 * 5.5 / 8


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("source", ["quantized", "random"])
def test_pack_gguf_reads_back_as_gguf_dequantizes(n, k, source):
    raw = quantized_blocks(n, k, seed=n + k) if source == "quantized" else random_blocks(n, k, seed=n * k)
    packed = pack_gguf(raw, MXFP4, n, k)
    assert (packed.fmt.bits, packed.fmt.group, packed.fmt.has_min, packed.fmt.zero, packed.fmt.name) == \
        (5, 32, False, 16, "MXFP4")
    assert packed.nbytes * 8 == n * k * 5.5
    ref = gguf_dequantized(raw, n, k)
    assert ref.abs().max() > 0
    got = packed.dequantize()
    assert got.dtype == torch.float32 and torch.equal(got, ref)
    # the codes: kvalue + 16, every kvalue (-12..12, -0 as 0) in a random tensor
    codes = packed.codes()
    assert codes.min() >= 4 and codes.max() <= 28
    if source == "random" and n * k >= 1024:
        assert set(codes.unique().tolist()) == {16 + v for v in (0, 1, 2, 3, 4, 6, 8, 12, -1, -2, -3, -4, -6, -8, -12)}
    # the field-wise planes are those of decoding every code and packing it
    blocks = np.ascontiguousarray(raw).reshape(-1, SIZE)
    decoded = decode_and_pack(blocks, MXFP4, n, k)
    for a, b in zip(packed.planes(), decoded.planes()):
        assert (a is None) == (b is None) and (a is None or (a.dtype == b.dtype and torch.equal(a, b)))


def test_every_exponent_in_range_and_every_code():
    """Each exponent 104..143 (2**-24 .. 2**15) with each of the 16 codes: one block per pairing, the
    code in all its nibbles."""
    exponents = np.arange(LOWEST, HIGHEST + 1, dtype=np.uint8)
    pairs = [(e, c) for e in exponents for c in range(16)]
    raw = np.zeros((len(pairs), SIZE), dtype=np.uint8)
    for i, (e, c) in enumerate(pairs):
        raw[i, 0], raw[i, 1:] = e, c | (c << 4)
    n, k = len(pairs), 32
    packed = pack_gguf(raw, MXFP4, n, k)
    assert torch.equal(packed.dequantize(), gguf_dequantized(raw, n, k))
    assert torch.equal(packed.scales.float().view(-1)[::16], torch.tensor([2.0 ** (int(e) - 128) for e in exponents]))


@pytest.mark.parametrize("n,k", [(8, 64), (16, 18 * 32), (24, 2880), (40, 96)])
def test_panel_layout_reads_back(n, k):
    for raw in (quantized_blocks(n, k, seed=3 * n + k), random_blocks(n, k, seed=5 * n + k)):
        rows = pack_gguf(raw, MXFP4, n, k)
        panels = rows.to_panels()
        assert panels.panels and panels.nbytes == rows.nbytes
        assert torch.equal(panels.dequantize(), gguf_dequantized(raw, n, k))
        for a, b in zip(panels.row_layout().planes(), rows.planes()):
            assert (a is None) == (b is None) and (a is None or torch.equal(a, b))


@pytest.mark.parametrize("n,k", SHAPES)
def test_hf_blocks_are_the_same_weights(n, k):
    """gpt-oss's checkpoint order (byte j: weights 2j, 2j + 1) of the same blocks packs to the same
    planes as the GGUF order, which read back as gguf dequantizes."""
    for raw in (quantized_blocks(n, k, seed=7 * n + k), random_blocks(n, k, seed=11 * n + k)):
        blocks, scales = gguf_to_hf(raw, n, k)
        packed = pack_mxfp4(blocks, scales)
        from_gguf = pack_gguf(raw, MXFP4, n, k)
        assert packed.fmt == from_gguf.fmt and packed.shape == (n, k)
        for a, b in zip(packed.planes(), from_gguf.planes()):
            assert (a is None) == (b is None) and (a is None or torch.equal(a, b))
        assert torch.equal(packed.dequantize(), gguf_dequantized(raw, n, k))


def transformers_dequantize():
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    convert = getattr(mxfp4, "convert_moe_packed_tensors", None)
    if convert is None:
        pytest.skip("transformers.integrations.mxfp4 has no convert_moe_packed_tensors")

    def dequantize(blocks: np.ndarray, scales: np.ndarray) -> torch.Tensor:
        # it takes [experts, n, k / 32, 16] and returns [experts, k, n] (gpt-oss's expert layout)
        out = convert(torch.from_numpy(blocks)[None], torch.from_numpy(scales)[None], dtype=torch.float32)
        return out[0].transpose(0, 1)
    return dequantize


@pytest.mark.parametrize("n,k", SHAPES)
def test_hf_blocks_read_back_as_transformers_dequantizes(n, k):
    dequantize = transformers_dequantize()
    rng = np.random.default_rng(n + 3 * k)
    blocks = rng.integers(0, 256, (n, k // 32, 16), dtype=np.uint8)
    scales = rng.integers(LOWEST, HIGHEST + 1, (n, k // 32), dtype=np.uint8)
    ref = dequantize(blocks, scales)
    assert ref.shape == (n, k) and ref.abs().max() > 0
    assert torch.equal(pack_mxfp4(blocks, scales).dequantize(), ref)
    # and gguf-quantized weights in the checkpoint's order
    raw = quantized_blocks(n, k, seed=n * k + 1)
    blocks, scales = gguf_to_hf(raw, n, k)
    assert torch.equal(pack_mxfp4(blocks, scales).dequantize(), dequantize(blocks, scales))


@pytest.mark.parametrize("exponent", [0, LOWEST - 1, HIGHEST + 1, 200, 255])
def test_a_scale_float16_cannot_hold_is_refused(exponent):
    n, k = 4, 64
    raw = random_blocks(n, k, seed=1).reshape(-1, SIZE).copy()
    raw[5, 0], raw[5, 1] = exponent, 0x21          # codes 1 and 2 in its first byte: nonzero
    with pytest.raises(ValueError, match=r"MXFP4: 1 block\(s\).*block 5: e8m0 exponent "
                                         rf"{exponent}, scale 2\*\*{exponent - 128}.*2\*\*-24 \.\. 2\*\*15"):
        pack_gguf(raw, MXFP4, n, k)
    blocks, scales = gguf_to_hf(raw, n, k)
    with pytest.raises(ValueError, match=r"MXFP4: .*2\*\*-24 \.\. 2\*\*15"):
        pack_mxfp4(blocks, scales)
    with pytest.raises(ValueError, match="MXFP4"):     # the reference decoder refuses it alike
        decode_and_pack(raw, MXFP4, n, k)


@pytest.mark.parametrize("exponent", [0, 1, LOWEST - 1, HIGHEST + 1, 255])
def test_zero_blocks_take_any_exponent(exponent):
    """A block of +-0 codes (nibbles 0 and 8) is zero whatever its exponent: scale 0 where float16
    cannot hold its own."""
    n, k = 2, 64
    raw = random_blocks(n, k, seed=2).reshape(-1, SIZE).copy()
    raw[1, 0], raw[1, 1:] = exponent, np.where(np.arange(16) % 3, 0x80, 0x08)
    packed = pack_gguf(raw, MXFP4, n, k)
    ref = gguf_dequantized(raw, n, k)
    assert torch.equal(packed.dequantize(), ref) and not ref[0, 32:].any()
    fits = LOWEST <= exponent <= HIGHEST
    assert packed.scales[0, 1].item() == (2.0 ** (exponent - 128) if fits else 0.0)
    blocks, scales = gguf_to_hf(raw, n, k)
    assert torch.equal(pack_mxfp4(blocks, scales).dequantize(), ref)


def test_bad_hf_shapes_are_refused():
    blocks = np.zeros((4, 2, 16), dtype=np.uint8)
    with pytest.raises(ValueError, match=r"\[n, k / 32, 16\]"):
        pack_mxfp4(blocks, np.zeros((4, 3), dtype=np.uint8))
    with pytest.raises(ValueError, match="uint8"):
        pack_mxfp4(blocks.astype(np.int16), np.zeros((4, 2), dtype=np.uint8))
