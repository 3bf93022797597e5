"""The quantized-weight kernel (twostep/kernels/csrc/quant/) and the packed layout against
the gguf package's own dequantizer, then float32 math: every GGUF type twostep keeps packed and
the formats --quantization makes, on edge shapes, through the SIMD build and the plain C++ one."""
from __future__ import annotations

from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import cpu_flags
from gguf import GGMLQuantizationType as QType

from twostep import kernels
from twostep.platforms.cpu.quant_linear import (BF16_GEMM_GEMV_MAX_ROWS, F32_GEMM_GEMV_MAX_ROWS, GEMV_MAX_ROWS,
                                                QuantizedLinearMethod)
from twostep.platforms.step_kind import decode_batch
from twostep.quantization.gguf_blocks import PACKED_TYPES, decode_and_pack, gguf_bits_per_weight, pack_gguf
from twostep.quantization.packed import PackedFormat, QuantizedWeight, pack
from twostep.quantization.quantize import quantize_weight

# K-quants' sub-block scales are multiplied out into float16 (packed.py): a relative 2**-11 at most
SCALE_ROUNDING = 2 ** -11
# the matrix-vector kernel quantizes activations per block of 32 to int16 (a relative 2**-16 each)
GEMV_RTOL = 2e-4
# int8 activations (a step of max|x| / 127 per block of 32): a random row's summed rounding errors
# against the largest output
INT8_RTOL = 2e-2


def int8_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the int8 product reads it: per block of 32, codes round(x / d), d = max|x| / 127,
    computed as the kernel computes them (float32, x times the reciprocal, ties to even)."""
    blocks = x.float().reshape(x.shape[0], -1, 32)
    d = blocks.abs().amax(dim=-1, keepdim=True) / 127
    inverse = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    return (torch.round(blocks * inverse) * d).reshape(x.shape)


def random_blocks(qtype: QType, n: int, k: int, seed: int) -> np.ndarray:
    """Random block bytes (any bit pattern is a valid block) with finite float16 scales."""
    rng = np.random.default_rng(seed)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n * k // block, size), dtype=np.uint8)
    halves = lambda: rng.uniform(-0.02, 0.02, raw.shape[0]).astype(np.float16).view(np.uint8).reshape(-1, 2)
    if qtype == QType.Q6_K:
        raw[:, 208:210] = halves()
    elif qtype == QType.MXFP4:          # e8m0 exponents whose scales 2**(e - 128) float16 holds
        raw[:, 0] = rng.integers(104, 144, raw.shape[0])
    else:
        raw[:, :2] = halves()
        if qtype in (QType.Q4_1, QType.Q5_1, QType.Q4_K, QType.Q5_K):
            raw[:, 2:4] = halves()
    return raw.reshape(n, -1)


def reference(raw: np.ndarray, qtype: QType, n: int, k: int) -> torch.Tensor:
    return torch.from_numpy(np.array(gguf.quants.dequantize(raw, qtype), dtype=np.float32)).reshape(n, k)


def kernel_builds():
    simd, portable = kernels.quant_linear(), kernels.quant_linear_portable()
    if simd is None or portable is None:
        pytest.skip("the quantized kernel needs g++ and ninja")
    return {"simd": simd, "portable": portable}


def int8_kernel(build: str):
    """The build whose int8 product a test checks: "simd" the native one; "avx2" the AVX2-only
    build, on CPUs whose native build has VNNI (elsewhere the native build is that one: skipped);
    "avx-vnni" the AVX-VNNI build without AVX-512 (avx_vnni_kernel); "other-dot" the native build
    with the small-row product's other step width (256 or 512-bit: kernels.wide_dot_flags()), on
    CPUs with AVX512-VNNI (elsewhere there is one width: skipped)."""
    kernel = kernel_builds()["simd"]
    if not kernel.has_int8():
        pytest.skip("the int8 product needs AVX2")
    if build == "simd":
        return kernel
    if build == "other-dot":
        return other_dot_kernel(kernel)
    if build == "avx-vnni":
        return avx_vnni_kernel()
    if kernel.path() == "avx2":
        pytest.skip("the native build is the AVX2 one here")
    avx2 = kernels.quant_linear_avx2()
    if avx2 is None:
        pytest.skip("the AVX2-only build of the kernel could not be built here")
    assert avx2.path() == "avx2" and 8 not in avx2.int8_bits()
    return avx2


def avx_vnni_kernel():
    """The build for AVX-VNNI without AVX-512 (the native one on Intel's client cores since Alder
    Lake), on CPUs that have both (elsewhere that build is the native one, or cannot run: skipped)."""
    if not {"avx_vnni", "avx512f"} <= cpu_flags():
        pytest.skip("the AVX-VNNI build is checked on CPUs with AVX-VNNI and AVX-512 (elsewhere it is native or absent)")
    build = kernels.quant_linear_avx_vnni()
    if build is None:
        pytest.skip("the AVX-VNNI build of the kernel could not be built here")
    assert build.path() == "avx-vnni" and 8 in build.int8_bits() and not (build.wide_pass() or build.wide_dot())
    return build


def other_dot_kernel(native):
    if "avx512_vnni" not in cpu_flags() or "avx512bw" not in cpu_flags():
        pytest.skip("the 512-bit steps of the small-row int8 product need AVX512-VNNI")
    other = kernels.quant_linear_other_dot()
    if other is None:
        pytest.skip("the other-width build of the kernel could not be built here")
    assert other.wide_dot() != native.wide_dot()
    return other


INT8_BUILDS = ["simd", "avx2", "avx-vnni", "other-dot"]


def shapes(qtype):
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    # K not a multiple of 256 where the type allows it; N odd, 1 and large; 18 blocks of 32 (SmolLM2's
    # 576): two passes of the kernel's 8-block loop and a tail
    extra = [(5, 18 * 32)] if block == 32 else []
    return [(1, block), (37, 3 * block), (129, 96 if block == 32 else 512),
            (8, 4864 if block == 32 else 4864 // 256 * 256), *extra]


CASES = [(q, n, k) for q in PACKED_TYPES for n, k in shapes(q)]


@pytest.mark.parametrize("qtype,n,k", CASES, ids=[f"{q.name}-{n}x{k}" for q, n, k in CASES])
def test_packed_layout_reads_back_as_gguf_dequantizes(qtype, n, k):
    raw = random_blocks(qtype, n, k, seed=n + k)
    packed = pack_gguf(raw, qtype, n, k)
    ref = reference(raw, qtype, n, k)
    exact = qtype in (QType.Q8_0, QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1, QType.MXFP4)
    tol = 0 if exact else SCALE_ROUNDING * ref.abs().max().item()
    torch.testing.assert_close(packed.dequantize(), ref, rtol=0, atol=tol)
    assert packed.nbytes * 8 / (n * k) <= gguf_bits_per_weight(qtype) + (1.25 if qtype == QType.MXFP4 else 0.5)
    # the planes cut from the blocks' bit fields: those of decoding every code and packing them (the
    # K-quants' scales share their code with the decoders: the gguf comparison above checks those)
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n * k // gguf.GGML_QUANT_SIZES[qtype][0], -1)
    decoded = decode_and_pack(blocks, qtype, n, k)
    for a, b in zip(packed.planes(), decoded.planes()):
        assert (a is None) == (b is None) and (a is None or (a.dtype == b.dtype and torch.equal(a, b)))


@pytest.mark.parametrize("build", ["simd", "portable", "avx-vnni"])
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 13, 64])
@pytest.mark.parametrize("qtype,n,k", CASES, ids=[f"{q.name}-{n}x{k}" for q, n, k in CASES])
def test_matmul_matches_float32_math(qtype, n, k, rows, build):
    kernel = avx_vnni_kernel() if build == "avx-vnni" else kernel_builds()[build]
    raw = random_blocks(qtype, n, k, seed=3 * n + k)
    weight = QuantizedWeight((pack_gguf(raw, qtype, n, k),))
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows + n))
    expected = F.linear(x, weight.dequantize())
    got = QuantizedLinearMethod(kernel).matmul(weight, x)
    scale = expected.abs().max().item()
    # rows beyond GEMV_MAX_ROWS are dequantized tiles through F.linear: float32 rounding only
    atol = (GEMV_RTOL if rows <= GEMV_MAX_ROWS else 1e-6) * scale
    torch.testing.assert_close(got, expected, rtol=0, atol=atol)
    # and the packed weights are gguf's: within the K-quants' scale rounding of its dequantizer
    direct = F.linear(x, reference(raw, qtype, n, k))
    torch.testing.assert_close(got, direct, rtol=0, atol=atol + 4 * SCALE_ROUNDING * scale)


@pytest.mark.parametrize("build", INT8_BUILDS)
@pytest.mark.parametrize("rows", [1, 3, 8, 13, 64])
@pytest.mark.parametrize("qtype,n,k", CASES, ids=[f"{q.name}-{n}x{k}" for q, n, k in CASES])
def test_int8_activations_product(qtype, n, k, rows, build):
    """--cpu-int8-activations: from part_int8_rows (1 for the panel layout, else 8; fewer
    rows keep the int16 product), exactly the product of the int8-rounded activations
    (4 to 6-bit codes, and 8-bit ones where the build has VNNI's u8 x s8 product; elsewhere they
    keep the int16 product), and near the float one."""
    kernel = int8_kernel(build)
    raw = random_blocks(qtype, n, k, seed=3 * n + k)
    weight = QuantizedWeight((pack_gguf(raw, qtype, n, k),))
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows + n))
    method, int16 = QuantizedLinearMethod(kernel, int8_activations="all"), QuantizedLinearMethod(kernel)
    expected = F.linear(x, weight.dequantize())
    scale = expected.abs().max().item()
    if weight.parts[0].fmt.bits not in kernel.int8_bits():
        torch.testing.assert_close(method.matmul(weight, x), int16.matmul(weight, x), rtol=0, atol=0)
        return
    exact = F.linear(int8_activations(x).double(), weight.dequantize().double()).float()
    panels = method.prepare(weight)          # the layout the engine binds (where it fits)
    for w in (weight, panels):
        got = method.matmul(w, x)
        if rows < method.part_int8_rows(w.parts[0]):
            assert torch.equal(got, int16.matmul(w, x))
            continue
        torch.testing.assert_close(got, exact, rtol=0, atol=1e-5 * scale)
        torch.testing.assert_close(got, expected, rtol=0, atol=INT8_RTOL * scale)
        # bf16 activations: what their float32 values give, rounded once
        half = x.bfloat16()
        torch.testing.assert_close(method.matmul(w, half), method.matmul(w, half.float()).bfloat16(), rtol=0, atol=0)
    if rows >= 8:        # the panel layout unpacks to the same bytes
        assert torch.equal(method.matmul(panels, x), method.matmul(weight, x))


def test_where_int8_activations_apply():
    """off: never; all: from the kernel's int8_min_rows (1 where the small-row product is: the SIMD
    builds, with their panel layout); decode (the engine's default): rows in a decode batch only (the
    model runner's step_kind.decode_batch), one user's included, of any dtype. Below int8_min_rows
    the int16 matrix-vector product bit for bit in every mode; a kernel without the int8 product is
    off whatever is asked."""
    kernel = kernel_builds()["simd"]
    if not kernel.has_int8():
        pytest.skip("the int8 product needs AVX2")
    first = kernel.int8_min_rows()
    assert first == 1             # the small-row kernel, wherever the int8 product is
    raw = random_blocks(QType.Q4_0, 40, 256, seed=1)
    plain = QuantizedLinearMethod(kernel)
    weight = plain.prepare(QuantizedWeight((pack_gguf(raw, QType.Q4_0, 40, 256),)))   # the panel layout
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(4)).bfloat16()
    assert plain.int8_mode == "off" and "int8" not in plain.name
    int16, int8 = plain.matmul(weight, x), QuantizedLinearMethod(kernel, "all").matmul(weight, x)
    seven = plain.matmul(weight, x[:7])
    assert not torch.equal(int16, int8)
    for batch in (False, True):
        with decode_batch(batch):
            for mode, on in (("off", False), ("all", True), ("decode", batch)):
                method = QuantizedLinearMethod(kernel, mode)
                assert torch.equal(method.matmul(weight, x), int8 if on else int16), (mode, batch)
                # 7 rows: each row's int8 sums as in the 8-row product, where the kernel takes 7
                assert torch.equal(method.matmul(weight, x[:7]), int8[:7] if on else seven)
            float32 = QuantizedLinearMethod(kernel, "decode").matmul(weight, x.float())
            # float32 rows too (what `auto` picks on CPUs without native bf16)
            assert torch.equal(float32, QuantizedLinearMethod(kernel, "all" if batch else "off").matmul(weight, x.float()))
    # a row-layout part (44 rows: no whole panels) has no small-row int8 kernel: 7 rows keep int16
    rows44 = QuantizedWeight((pack_gguf(random_blocks(QType.Q4_0, 44, 256, seed=2), QType.Q4_0, 44, 256),))
    assert not plain.prepare(rows44).parts[0].panels
    assert torch.equal(QuantizedLinearMethod(kernel, "all").matmul(rows44, x[:7]), plain.matmul(rows44, x[:7]))
    assert "decode batches" in QuantizedLinearMethod(kernel, "decode").name
    assert QuantizedLinearMethod(kernel_builds()["portable"], "all").int8_mode == "off"
    with pytest.raises(ValueError, match="off, decode, all"):
        QuantizedLinearMethod(kernel, "sometimes")


@pytest.mark.parametrize("build", ["simd", "portable"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("qtype", [QType.Q4_1, QType.Q8_0, QType.Q6_K])
def test_half_precision_activations(qtype, dtype, build):
    """bf16 / fp16 inputs (quantized in vectors on the SIMD build) give what their float32 values give."""
    kernel = kernel_builds()[build]
    n, k = 37, 512
    weight = QuantizedWeight((pack_gguf(random_blocks(qtype, n, k, seed=5), qtype, n, k),))
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(2)).to(dtype)
    method = QuantizedLinearMethod(kernel)
    got, exact = method.matmul(weight, x), method.matmul(weight, x.float())
    assert got.dtype == dtype
    torch.testing.assert_close(got, exact.to(dtype), rtol=0, atol=0)


@pytest.mark.parametrize("build", ["simd", "portable"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_are_dequantized_for_an_embedding(build, dtype):
    kernel = kernel_builds()[build]
    raw = random_blocks(QType.Q8_0, 50, 64, seed=7)
    weight = QuantizedWeight((pack_gguf(raw, QType.Q8_0, 50, 64),))
    ids = torch.tensor([[0, 49, 7], [7, 7, 3]])
    got = QuantizedLinearMethod(kernel).embed(weight, ids, dtype)
    assert got.shape == (2, 3, 64) and got.dtype == dtype
    torch.testing.assert_close(got, weight.dequantize(dtype)[ids], rtol=0, atol=0)


@pytest.mark.parametrize("build", ["simd", "portable"])
@pytest.mark.parametrize("method,bits", [("int8", 8.5), ("int4", 5.0)])
def test_load_time_formats(build, method, bits):
    kernel = kernel_builds()[build]
    g = torch.Generator().manual_seed(11)
    w = torch.randn(96, 4864, generator=g) * 0.05
    packed = quantize_weight(w, method)
    assert packed.nbytes * 8 / w.numel() <= bits
    step = (w.abs().amax(dim=1, keepdim=True) / 127) if method == "int8" else None
    error = (packed.dequantize() - w).abs()
    if method == "int8":        # round to nearest: at most half a step per channel
        assert (error <= step / 2 * 1.01).all()
    else:                       # 16 levels per group of 32: half a step of (max - min) / 15
        groups = w.view(96, -1, 32)
        half_step = ((groups.amax(-1) - groups.amin(-1)) / 30).repeat_interleave(32, dim=1)
        assert (error <= half_step * 1.01 + 1e-3 * w.abs().max()).all()
    x = torch.randn(2, 4864, generator=g)
    expected = F.linear(x, packed.dequantize())
    got = QuantizedLinearMethod(kernel).matmul(QuantizedWeight((packed,)), x)
    torch.testing.assert_close(got, expected, rtol=0, atol=GEMV_RTOL * expected.abs().max().item())


def wide_group_weight(bits: int, group: int, has_min: bool, n: int = 48, k: int = 768) -> QuantizedWeight:
    """Random codes with a scale (and min) per `group` weights: groups of several blocks of 32."""
    rng = np.random.default_rng(bits * group)
    if bits == 8:
        codes = rng.integers(-127, 128, (n, k), dtype=np.int8)
    else:
        codes = rng.integers(0, 1 << bits, (n, k), dtype=np.uint8)
    scales = rng.uniform(0.001, 0.01, (n, k // group)).astype(np.float32)
    mins = -rng.uniform(0.0, 0.05, (n, k // group)).astype(np.float32) if has_min else None
    return QuantizedWeight((pack(codes, scales, mins, PackedFormat(bits, group, has_min, f"g{group}")),))


@pytest.mark.parametrize("build", ["simd", "portable"])
@pytest.mark.parametrize("bits,group,has_min", [(4, 64, True), (5, 128, False), (8, 128, False), (6, 256, True)])
def test_groups_of_several_blocks_in_every_product(bits, group, has_min, build):
    """A scale (and min) per 64-256 weights (each group's blocks counted in the kernels' loops, no
    division): the passes at 1-8 rows, the int8 product from 1 row and in tiles, the matrix-matrix
    product past the passes (float32 and bf16 rows), in the row and the panel layouts, and dequantized
    rows: the float product of the dequantized weights (the int8 product: of the int8-rounded
    activations). Where a build has no panel layout (portable) the second pass repeats the row
    layout; the int8 product runs where the build takes the code width (not portable; 8-bit codes
    only with VNNI)."""
    kernel = kernel_builds()[build]
    weight = wide_group_weight(bits, group, has_min)
    method, int8 = QuantizedLinearMethod(kernel), QuantizedLinearMethod(kernel, int8_activations="all")
    dense = weight.dequantize()
    for w in (weight, method.prepare(weight)):
        torch.testing.assert_close(method.dequantize(w.parts[0], torch.arange(w.n), torch.float32), dense,
                                   rtol=0, atol=0)
        for rows in (1, 3, 8, 13, 40):
            x = torch.randn(rows, w.k, generator=torch.Generator().manual_seed(rows))
            expected = F.linear(x, dense)
            scale = expected.abs().max().item()
            torch.testing.assert_close(method.matmul(w, x), expected, rtol=0, atol=GEMV_RTOL * scale)
            half = x.bfloat16()             # bf16 rows (gemm_bf16 past the passes where the CPU has it)
            torch.testing.assert_close(method.matmul(w, half).float(), F.linear(half.float(), dense),
                                       rtol=2 ** -7, atol=2 ** -7 * scale)
            if bits in int8.int8_bits and rows >= int8.part_int8_rows(w.parts[0]) > 0:
                exact = F.linear(int8_activations(x).double(), dense.double()).float()
                torch.testing.assert_close(int8.matmul(w, x), exact, rtol=0, atol=1e-5 * scale)


PANEL_TYPES = [QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1, QType.Q8_0, QType.Q4_K, QType.Q5_K, QType.Q6_K]
K_QUANTS = (QType.Q4_K, QType.Q5_K, QType.Q6_K)
PANEL_CASES = [(q, n, k) for q in PANEL_TYPES
               for n, k in ((8, 256), (16, 512), (40, 18 * 32 if q not in K_QUANTS else 768), (24, 4864 // 256 * 256))]


def panel_kernel():
    kernel = kernel_builds()["simd"]
    if not kernel.has_panels():
        pytest.skip("the panel layout's product needs the kernel built with AVX2")
    return kernel


@pytest.mark.parametrize("qtype,n,k", PANEL_CASES, ids=[f"{q.name}-{n}x{k}" for q, n, k in PANEL_CASES])
def test_panel_layout_is_the_reference_layout(qtype, n, k):
    """The kernel's pack_panels writes what packed.py's to_panels describes, and it reads back."""
    method = QuantizedLinearMethod(panel_kernel())
    rows = pack_gguf(random_blocks(qtype, n, k, seed=n * k), qtype, n, k)
    panels = method.prepare(QuantizedWeight((rows,))).parts[0]
    reference_panels = rows.to_panels()
    row_bytes = rows.qs.shape[1] + (0 if rows.qh is None else rows.qh.shape[1])     # codes and high bits
    assert panels.panels and panels.qh is None and panels.qs.shape == (n // 8, k // 32, row_bytes * 8 // (k // 32))
    for got, want in zip(panels.planes(), reference_panels.planes()):
        assert (got is None) == (want is None) and (got is None or torch.equal(got, want))
    for got, want in zip(panels.row_layout().planes(), rows.planes()):
        assert (got is None) == (want is None) and (got is None or torch.equal(got, want))
    assert panels.nbytes == rows.nbytes
    torch.testing.assert_close(panels.dequantize(), rows.dequantize(), rtol=0, atol=0)
    with pytest.raises(ValueError, match="row layout"):
        panels.rows(torch.arange(8))


def in_passes(kernel, part, x: torch.Tensor) -> torch.Tensor:
    """x against one part in passes of the matrix-vector product, 8 rows each."""
    out = torch.empty(x.shape[0], part.n, dtype=x.dtype)
    for first in range(0, x.shape[0], 8):
        kernel.gemv(x[first:first + 8], *part.planes(), part.fmt.bits, part.fmt.group, part.fmt.zero, out[first:first + 8])
    return out


@pytest.mark.parametrize("qtype", [QType.Q8_0, QType.Q4_0, QType.Q6_K])
def test_panel_passes_take_a_batch_in_one_call(qtype):
    """Up to panel_call_rows() rows in one call of the panel layout's passes (the weights read once),
    each row's sums those of calls of 8 rows bit for bit; one row more: a clear error."""
    kernel = panel_kernel()
    part = QuantizedLinearMethod(kernel).prepare(
        QuantizedWeight((pack_gguf(random_blocks(qtype, 64, 256, seed=3), qtype, 64, 256),))).parts[0]
    assert part.panels
    limit = kernel.panel_call_rows()
    x = torch.randn(limit + 1, 256, generator=torch.Generator().manual_seed(11))
    args = (*part.planes(), part.fmt.bits, part.fmt.group, part.fmt.zero)
    for rows in (9, 32, limit):
        out = torch.empty(rows, part.n)
        kernel.gemv(x[:rows], *args, out)
        assert torch.equal(out, in_passes(kernel, part, x[:rows]))
    with pytest.raises(RuntimeError, match="rows"):
        kernel.gemv(x, *args, torch.empty(limit + 1, part.n))


@pytest.mark.parametrize("build", ["simd", "avx-vnni"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 13, 40, 64, 96])
@pytest.mark.parametrize("qtype,n,k", PANEL_CASES, ids=[f"{q.name}-{n}x{k}" for q, n, k in PANEL_CASES])
def test_panel_layout_product(qtype, n, k, rows, build):
    """Weights bound in the panel layout multiply as the row layout's within float rounding (up to
    gemv_max_rows: passes of the panel product; more: dequantized tiles, bit for bit, or float32
    rows through gemm_f32 where the build has it, within float32 rounding)."""
    method = QuantizedLinearMethod(avx_vnni_kernel() if build == "avx-vnni" else panel_kernel())
    weight = QuantizedWeight((pack_gguf(random_blocks(qtype, n, k, seed=5 * n + k), qtype, n, k),))
    panels = method.prepare(weight)
    assert panels.parts[0].panels
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows * k))
    expected = F.linear(x, weight.dequantize())
    scale = expected.abs().max().item()
    got = method.matmul(panels, x)
    passes = rows <= method.gemv_max_rows(panels, x.dtype)
    if not passes and method.f32_gemm:         # float32 math (the row layout: passes or tiles)
        torch.testing.assert_close(got, expected, rtol=0, atol=4e-6 * scale)
    elif not passes:
        assert torch.equal(got, method.matmul(weight, x))
    torch.testing.assert_close(got, expected, rtol=0, atol=GEMV_RTOL * scale)
    torch.testing.assert_close(got, method.matmul(weight, x), rtol=0, atol=GEMV_RTOL * scale)
    half = x.bfloat16()
    if rows <= method.gemv_max_rows(panels, half.dtype):   # bf16 inputs in passes: the float32 sums rounded once
        assert torch.equal(method.matmul(panels, half), in_passes(method.kernel, panels.parts[0], half.float()).bfloat16())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_panel_layout_rows_are_dequantized(dtype):
    """Embedding lookups and tiles read the panel layout: whole panels and single rows alike."""
    method = QuantizedLinearMethod(panel_kernel())
    for qtype, k in ((QType.Q8_0, 96), (QType.Q4_1, 96), (QType.Q5_0, 96), (QType.Q6_K, 256), (QType.Q5_K, 256)):
        weight = QuantizedWeight((pack_gguf(random_blocks(qtype, 48, k, seed=9), qtype, 48, k),))
        panels = method.prepare(weight)
        for ids in (torch.arange(48), torch.tensor([[0, 47, 7], [7, 7, 3]]), torch.arange(8, 24), torch.arange(3, 19)):
            torch.testing.assert_close(method.embed(panels, ids, dtype), method.embed(weight, ids, dtype),
                                       rtol=0, atol=0)


def test_panel_layout_with_int8_activations():
    """The int8 product unpacks the panel layout to the same panels as the row layout: equal outputs."""
    kernel = panel_kernel()
    method = QuantizedLinearMethod(kernel, int8_activations="all")
    for qtype in (QType.Q4_0, QType.Q4_K, QType.Q5_0, QType.Q5_K, QType.Q6_K):
        weight = QuantizedWeight((pack_gguf(random_blocks(qtype, 40, 512, seed=2), qtype, 40, 512),))
        x = torch.randn(19, 512, generator=torch.Generator().manual_seed(1))
        assert torch.equal(method.matmul(method.prepare(weight), x), method.matmul(weight, x))


# where each format's codes start in its GGUF block (every byte after: codes; before: scales)
CODE_BYTES = {QType.Q4_0: slice(2, None), QType.Q5_0: slice(2, None), QType.Q4_K: slice(16, None),
              QType.Q5_K: slice(16, None), QType.Q6_K: slice(0, 192)}


@pytest.mark.parametrize("build", INT8_BUILDS)
@pytest.mark.parametrize("qtype", list(CODE_BYTES))
def test_the_int8_product_at_its_largest_sums(qtype, build):
    """Every code at its largest and every activation at +-127 (a constant row): the int16 sums of
    vpmaddubsw (AVX2) reach their bound (2 x steps x max code x 127), so a path that adds one step
    too many in int16 wraps; each path (1-7 rows the small-row kernel, 8 a tile, 11 the unpacked
    panels) gives the exact product of the int8-rounded activations."""
    kernel = int8_kernel(build)
    n, k = 16, 512
    raw = random_blocks(qtype, n, k, seed=11)
    raw.reshape(n * k // gguf.GGML_QUANT_SIZES[qtype][0], -1)[:, CODE_BYTES[qtype]] = 0xFF
    weight = QuantizedWeight((pack_gguf(raw, qtype, n, k),))
    method = QuantizedLinearMethod(kernel, int8_activations="all")
    panels = method.prepare(weight)
    assert panels.parts[0].panels
    signs = torch.tensor([1.0, -1.0, 0.5, -3.0, 2.0, -0.25, 1.0, -1.0, 4.0, -2.0, 1.0])
    x = signs[:, None].expand(11, k).contiguous()           # each row one value: codes +-127
    exact = F.linear(int8_activations(x).double(), weight.dequantize().double()).float()
    for rows in (1, 2, 3, 4, 5, 7, 8, 11):
        got = method.matmul(panels, x[:rows])
        torch.testing.assert_close(got, exact[:rows], rtol=1e-5, atol=1e-5 * exact.abs().max().item())


@pytest.mark.parametrize("build", INT8_BUILDS)
@pytest.mark.parametrize("qtype", PANEL_TYPES + ["int8", "int4"])
def test_an_int8_rows_sums_do_not_depend_on_its_batch(qtype, build):
    """The int8 product's paths (the small-row kernel below 8 rows, the panel tiles decoded in
    registers at 8, the unpacked panels from 9) give each row the same bits whatever the number of
    rows beside it, for every format and both output dtypes: a decode row's logits do not depend on
    its batch. And near the int16 product (int8's rounding)."""
    kernel = int8_kernel(build)
    threads = torch.get_num_threads()
    # panels in pairs and not (40 rows: five panels), groups a multiple of four and not (k 576: 18)
    for n, k in ((48, 512), (40, 576 if qtype not in K_QUANTS else 768)):
        if isinstance(qtype, str):
            weight = QuantizedWeight((quantize_weight(torch.randn(n, k, generator=torch.Generator().manual_seed(3)), qtype),))
        else:
            weight = QuantizedWeight((pack_gguf(random_blocks(qtype, n, k, seed=7), qtype, n, k),))
        part = QuantizedLinearMethod(kernel).prepare(weight).parts[0]
        assert part.panels
        if part.fmt.bits not in kernel.int8_bits():
            pytest.skip(f"this build's int8 product does not take {part.fmt.bits}-bit codes")
        args = (*part.planes(), part.fmt.bits, part.fmt.group, part.fmt.zero)
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.randn(11, k, generator=torch.Generator().manual_seed(5)).to(dtype)
            every = torch.empty(11, n, dtype=dtype)
            kernel.gemm_int8(x, *args, every)
            try:
                for threads_now in (1, threads):       # threads change which panels go in pairs
                    torch.set_num_threads(threads_now)
                    for rows in range(1, 11):
                        got = torch.empty(rows, n, dtype=dtype)
                        kernel.gemm_int8(x[:rows], *args, got)
                        assert torch.equal(got, every[:rows]), (n, k, dtype, rows, threads_now)
            finally:
                torch.set_num_threads(threads)
            int16 = torch.empty(8, n, dtype=dtype)
            kernel.gemv(x[:8], *args, int16)
            scale = int16.float().abs().max().item()
            torch.testing.assert_close(every[:8].float(), int16.float(), rtol=0, atol=INT8_RTOL * scale)


@pytest.mark.parametrize("qtype", PANEL_TYPES + ["int8", "int4"])
def test_both_step_widths_of_the_small_row_product_give_the_same_bits(qtype):
    """The small-row int8 product in 512-bit steps (two step pairs a vector) and in 256-bit ones
    adds the same int32 sums in other lanes: the same outputs bit for bit, 1-7 rows, both dtypes."""
    native = int8_kernel("simd")
    other = int8_kernel("other-dot")
    n, k = 48, 768
    if isinstance(qtype, str):
        weight = QuantizedWeight((quantize_weight(torch.randn(n, k, generator=torch.Generator().manual_seed(3)), qtype),))
    else:
        weight = QuantizedWeight((pack_gguf(random_blocks(qtype, n, k, seed=9), qtype, n, k),))
    part = QuantizedLinearMethod(native).prepare(weight).parts[0]
    assert part.panels and part.fmt.bits in native.int8_bits()
    args = (*part.planes(), part.fmt.bits, part.fmt.group, part.fmt.zero)
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(7, k, generator=torch.Generator().manual_seed(4)).to(dtype)
        for rows in range(1, 8):
            got, expected = torch.empty(rows, n, dtype=dtype), torch.empty(rows, n, dtype=dtype)
            native.gemm_int8(x[:rows], *args, got)
            other.gemm_int8(x[:rows], *args, expected)
            assert torch.equal(got, expected), (dtype, rows)


def test_panel_layout_only_where_it_fits():
    """Row counts not a multiple of 8 keep the row layout; the portable build (no panel product)
    keeps it for everything."""
    method = QuantizedLinearMethod(panel_kernel())
    for qtype, n in ((QType.Q6_K, 12), (QType.Q5_0, 20), (QType.Q4_0, 12)):
        k = 256
        weight = QuantizedWeight((pack_gguf(random_blocks(qtype, n, k, seed=1), qtype, n, k),))
        assert not method.prepare(weight).parts[0].panels
    portable = kernel_builds()["portable"]
    assert not portable.has_panels()
    weight = QuantizedWeight((pack_gguf(random_blocks(QType.Q4_0, 16, 256, seed=1), QType.Q4_0, 16, 256),))
    assert not QuantizedLinearMethod(portable).prepare(weight).parts[0].panels


def test_stacked_parts_of_different_formats():
    """A fused projection whose parts differ in format (a Q4_K_M file's Q6_K attn_v) runs part by part."""
    kernel = kernel_builds()["simd"]
    parts = [pack_gguf(random_blocks(q, n, 256, seed=n), q, n, 256)
             for q, n in ((QType.Q4_K, 64), (QType.Q4_K, 16), (QType.Q6_K, 16))]
    weight = QuantizedWeight.stack(parts)
    assert weight.format_names == ["Q4_K", "Q6_K"] and weight.n == 96
    x = torch.randn(3, 256)
    expected = F.linear(x, torch.cat([p.dequantize() for p in parts]))
    for rows in (x[:1], x):
        got = QuantizedLinearMethod(kernel).matmul(weight, rows)
        torch.testing.assert_close(got, expected[: rows.shape[0]], rtol=0, atol=GEMV_RTOL * expected.abs().max().item())


@pytest.mark.parametrize("int8", ["off", "all"])
def test_the_decode_stacks_linear_computes_what_the_ops_compute(int8):
    """The decode stack's FusedLinear calls a part's product through its planes checked at load
    (planes_product, not the dispatcher): the same outputs bit for bit as the method's own calls,
    part by part, plus the bias as `y + bias` rounds it; x of another width: a clear error."""
    stack = kernels.decode_step()
    if stack is None or not kernel_builds()["simd"].has_panels():
        pytest.skip("the decode stack needs the kernels built with AVX2")
    method = QuantizedLinearMethod(kernel_builds()["simd"], int8_activations=int8)
    parts = [pack_gguf(random_blocks(q, n, 512, seed=n), q, n, 512)
             for q, n in ((QType.Q4_0, 64), (QType.Q4_0, 16), (QType.Q6_K, 24))]
    weight = method.prepare(QuantizedWeight.stack(parts))
    bias = torch.randn(weight.n, generator=torch.Generator().manual_seed(3)).bfloat16()
    for b in (None, bias):
        fused, _ = method.fused(SimpleNamespace(out_features=weight.n, plain_bias=b, quantized=weight), stack,
                                torch.bfloat16)
        for rows in (1, 3):
            x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows)).bfloat16()
            with decode_batch(True):
                expected = method.matmul(weight, x)
            assert torch.equal(fused(x), expected if b is None else expected + b)
    with pytest.raises(RuntimeError, match=r"x \[M, 512\]"):
        fused(torch.randn(1, 544).bfloat16())


def test_kernel_paths_are_named():
    """The build takes the path this CPU's features select (not silently a plainer one)."""
    builds = kernel_builds()
    assert builds["portable"].path() == "scalar"
    flags = cpu_flags()
    if {"avx2", "fma", "f16c"} <= flags:
        expected = "avx2"
        if "avx_vnni" in flags:
            expected = "avx-vnni"
        elif {"avx512_vnni", "avx512vl"} <= flags:
            expected = "avx512-vnni"
        assert builds["simd"].path() == expected
        assert builds["simd"].has_int8() and builds["simd"].has_panels()
        # 8-bit codes in the int8 product: VNNI's u8 x s8 product (vpdpbusd) sums in int32
        assert set(builds["simd"].int8_bits()) == ({4, 5, 6} if expected == "avx2" else {4, 5, 6, 8})
        # 512-bit steps in the small-row int8 product where the CPU runs them at full width (Zen 5)
        wide = bool(kernels.wide_dot_flags()) and {"avx512_vnni", "avx512bw"} <= flags
        assert builds["simd"].wide_dot() == wide
    assert not builds["portable"].has_int8() and not builds["portable"].has_panels()


@pytest.mark.parametrize("qtype,bits", [(QType.Q4_0, 4.5), (QType.Q8_0, 8.5), (QType.Q4_1, 5.0),
                                        (QType.Q4_K, 5.0), (QType.Q5_K, 6.0), (QType.Q6_K, 7.0)])
def test_bytes_held_match_the_packed_layout(qtype, bits):
    """What `twostep analyze` counts for a GGUF tensor is what pack_gguf really allocates."""
    from twostep.quantization.gguf_blocks import held_bytes

    n, k = 8, 512
    raw = random_blocks(qtype, n, k, seed=1)
    assert held_bytes(qtype, [k, n], raw.nbytes) == pack_gguf(raw, qtype, n, k).nbytes == n * k * bits / 8


def test_wide_pass_builds_take_more_rows_in_passes():
    """With the 8-row pass (AVX-512 builds) 4 and 8-bit panels take up to 64 fp16 rows in passes
    of the matrix-vector product, 6-bit ones 32 (the measured crossovers with dequantized tiles), bf16
    rows up to 16 where the build has gemm_bf16 (else as fp16); float32 rows up to 8 (8-bit codes 16)
    where an AVX2 build has gemm_f32; row layouts and other builds 32."""
    kernel = panel_kernel()
    method = QuantizedLinearMethod(kernel)
    weights = {q: QuantizedWeight((pack_gguf(random_blocks(q, 16, 256, seed=1), q, 16, 256),))
               for q in (QType.Q4_0, QType.Q8_0, QType.Q6_K)}
    for w in weights.values():
        assert method.gemv_max_rows(w, torch.bfloat16) == GEMV_MAX_ROWS            # the row layout
        assert method.gemv_max_rows(w, torch.float32) == GEMV_MAX_ROWS
    f32 = [method.gemv_max_rows(method.prepare(w), torch.float32) for w in weights.values()]
    assert f32 == ([8, 16, 8] if kernel.has_f32_gemm() and not kernel.wide_pass() else [GEMV_MAX_ROWS] * 3)
    if not kernel.wide_pass():
        pytest.skip("this build has no 8-row pass (AVX2 or portable)")
    assert [method.gemv_max_rows(method.prepare(w), torch.float16) for w in weights.values()] == [64, 64, 32]
    bf16 = [method.gemv_max_rows(method.prepare(w), torch.bfloat16) for w in weights.values()]
    assert bf16 == ([BF16_GEMM_GEMV_MAX_ROWS] * 3 if kernel.has_bf16_gemm() else [64, 64, 32])


def bf16_gemm_kernel():
    kernel = panel_kernel()
    if not kernel.has_bf16_gemm():
        pytest.skip("gemm_bf16 needs AVX512-BF16 (or AMX) and torch's oneDNN brgemm")
    return kernel


# 64 weight rows a thread dequantizes at a time, two panels a store: tails of 8 (one panel), 40 (two
# pairs and one) and 56; 1024 weights of k a brgemm call, so 1056 / 1280 take a second call that adds
# to the first's sums; 100 rows: calls of 96 and 4 (from 64 rows, 16s and the rest); 300: a block of
# 256 and a tail of 44. Plus --quantization's int8 (one scale a row) and int4 (groups of 32, a min).
GEMM_CASES = [(q, n, k) for q in [*PACKED_TYPES, "int8", "int4"]
              for n, k in ([(8, 32), (136, 96), (40, 1056), (120, 64)] if q in ("int8", "int4") or gguf.GGML_QUANT_SIZES[q][0] == 32
                           else [(8, 256), (136, 512), (40, 1280), (120, 256)])]


def gemm_weight(qtype, n: int, k: int) -> QuantizedWeight:
    if qtype in ("int8", "int4"):
        return QuantizedWeight((quantize_weight(torch.randn(n, k, generator=torch.Generator().manual_seed(n + k)), qtype),))
    return QuantizedWeight((pack_gguf(random_blocks(qtype, n, k, seed=n + k), qtype, n, k),))


@pytest.mark.parametrize("rows", [1, 17, 100, 300])
@pytest.mark.parametrize("qtype,n,k", GEMM_CASES, ids=[f"{getattr(q, 'name', q)}-{n}x{k}" for q, n, k in GEMM_CASES])
def test_bf16_gemm_product(qtype, n, k, rows):
    """gemm_bf16: bf16 rows against the panel layout, the weights dequantized and rounded to bf16 as
    the tiles round them, float32 sums rounded to bf16: within a bf16 step of that float32 product
    (the packed weights against gguf's dequantizer: test_packed_layout_reads_back_as_gguf_dequantizes),
    into a view of wider rows without touching the columns beside it."""
    kernel = bf16_gemm_kernel()
    panels = QuantizedLinearMethod(kernel).prepare(gemm_weight(qtype, n, k)).parts[0]
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16()
    expected = x.float() @ panels.dequantize().bfloat16().float().t()
    wide = torch.full((rows, n + 16), 7.0, dtype=torch.bfloat16)
    kernel.gemm_bf16(x, *panels.planes(), panels.fmt.bits, panels.fmt.group, panels.fmt.zero, wide[:, 8:8 + n])
    assert torch.all(wide[:, :8] == 7) and torch.all(wide[:, 8 + n:] == 7)
    torch.testing.assert_close(wide[:, 8:8 + n].float(), expected, rtol=2 ** -7, atol=1e-5 * expected.abs().max().item())


def test_bf16_gemm_is_the_prefill_product():
    """On a CPU with AVX512-BF16 the build has gemm_bf16, and a bf16 prompt's rows against the panel
    layout take it (not the dequantized tiles): one quant_gemm_bf16 call per part, no dequantize_rows."""
    kernel = panel_kernel()
    if {"avx512_bf16", "avx512vl", "avx512bw"} <= cpu_flags() or "amx_bf16" in cpu_flags():
        assert kernel.has_bf16_gemm()
    kernel = bf16_gemm_kernel()
    method = QuantizedLinearMethod(kernel)
    parts = [pack_gguf(random_blocks(q, n, 256, seed=n), q, n, 256) for q, n in ((QType.Q4_K, 64), (QType.Q6_K, 16))]
    weight = method.prepare(QuantizedWeight.stack(parts))
    x = torch.randn(BF16_GEMM_GEMV_MAX_ROWS + 1, 256).bfloat16()
    with torch.profiler.profile() as prof:
        got = method.matmul(weight, x)
    names = [e.name for e in prof.events()]
    assert names.count("twostep::quant_gemm_bf16") == 2 and "twostep::quant_dequantize_rows" not in names
    tiles = torch.cat([method.dequantize(p, torch.arange(p.n), torch.bfloat16) for p in weight.parts])
    torch.testing.assert_close(got.float(), (x.float() @ tiles.float().t()), rtol=2 ** -7, atol=1e-3)
    x = torch.randn(70, 256).bfloat16()      # past every crossover of the passes
    got = method.matmul(weight, x)
    with torch.backends.mkldnn.flags(enabled=False):     # brgemm is oneDNN's: the tiles then
        torch.testing.assert_close(method.matmul(weight, x).float(), got.float(), rtol=2 ** -7, atol=1e-3)
    method.bf16_gemm = False                  # the tiles, as a CPU without it runs them: the same product
    with torch.profiler.profile() as prof:
        tiled = method.matmul(weight, x)
    assert "twostep::quant_dequantize_rows" in [e.name for e in prof.events()]
    torch.testing.assert_close(tiled.float(), got.float(), rtol=2 ** -7, atol=1e-3)


def f32_gemm_kernel():
    kernel = panel_kernel()
    if not kernel.has_f32_gemm():
        pytest.skip("gemm_f32 needs torch's oneDNN float brgemm")
    return kernel


@pytest.mark.parametrize("rows", [1, 17, 100, 300])
@pytest.mark.parametrize("qtype,n,k", GEMM_CASES, ids=[f"{getattr(q, 'name', q)}-{n}x{k}" for q, n, k in GEMM_CASES])
def test_f32_gemm_product(qtype, n, k, rows):
    """gemm_f32: float32 rows against the panel layout, the weights dequantized 64 rows x 1024 weights
    at a time in float32: the float32 product of the dequantized weights within float32 rounding
    (brgemm's order of the sums, not MKL's), into a view of wider rows without touching the columns
    beside it."""
    kernel = f32_gemm_kernel()
    panels = QuantizedLinearMethod(kernel).prepare(gemm_weight(qtype, n, k)).parts[0]
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    expected = (x.double() @ panels.dequantize().double().t()).float()
    wide = torch.full((rows, n + 16), 7.0)
    kernel.gemm_f32(x, *panels.planes(), panels.fmt.bits, panels.fmt.group, panels.fmt.zero, wide[:, 8:8 + n])
    assert torch.all(wide[:, :8] == 7) and torch.all(wide[:, 8 + n:] == 7)
    torch.testing.assert_close(wide[:, 8:8 + n], expected, rtol=0, atol=4e-6 * expected.abs().max().item())


def test_f32_gemm_is_the_prefill_product():
    """Where torch's float brgemm runs (oneDNN's, AVX2 and AVX-512 builds), a float32 prompt's rows
    against the panel layout take gemm_f32 past the crossovers (not the dequantized tiles): one
    quant_gemm_f32 call per part, no dequantize_rows; the tiles give the same product. Each part
    has its own code width's crossover (8-bit codes keep their passes longer)."""
    kernel = f32_gemm_kernel()
    method = QuantizedLinearMethod(kernel)
    assert method.f32_gemm
    parts = [pack_gguf(random_blocks(q, n, 256, seed=n), q, n, 256) for q, n in ((QType.Q4_K, 64), (QType.Q8_0, 16))]
    weight = method.prepare(QuantizedWeight.stack(parts))
    four, eight = (method.part_gemv_max_rows(p, torch.float32) for p in weight.parts)
    if kernel.wide_pass():      # AVX-512: the 8-row pass keeps its 32 rows, then gemm_f32 for every width
        assert four == eight == GEMV_MAX_ROWS
    else:                       # AVX2: the measured crossovers
        assert (four, eight) == (F32_GEMM_GEMV_MAX_ROWS[4], F32_GEMM_GEMV_MAX_ROWS[8]) and four < eight
    x = torch.randn(eight + 1, 256)
    with torch.profiler.profile() as prof:
        got = method.matmul(weight, x)
    names = [e.name for e in prof.events()]
    assert names.count("twostep::quant_gemm_f32") == 2 and "twostep::quant_dequantize_rows" not in names
    if four < eight:
        with torch.profiler.profile() as prof:      # between the crossovers: the 4-bit part's gemm_f32, the 8-bit's passes
            method.matmul(weight, x[:four + 1])
        names = [e.name for e in prof.events()]
        assert names.count("twostep::quant_gemm_f32") == 1 and names.count("twostep::quant_gemv") == 1
    with torch.profiler.profile() as prof:      # up to the crossover: each part's passes in one call
        method.matmul(weight, x[:four])
    names = [e.name for e in prof.events()]
    assert names.count("twostep::quant_gemm_f32") == 0 and names.count("twostep::quant_gemv") == 2
    x = torch.randn(70, 256)
    got = method.matmul(weight, x)
    method.f32_gemm = False                  # the tiles, as a CPU without it runs them: the same product
    with torch.profiler.profile() as prof:
        tiled = method.matmul(weight, x)
    assert "twostep::quant_dequantize_rows" in [e.name for e in prof.events()]
    torch.testing.assert_close(tiled, got, rtol=0, atol=4e-6 * got.abs().max().item())


def test_a_row_layout_part_keeps_its_passes():
    """Each part of a stacked weight picks its own product: a part in the row layout (rows not a
    multiple of 8) keeps passes of the matrix-vector product up to 32 rows beside a panel part that
    takes gemm_bf16 from 17."""
    method = QuantizedLinearMethod(bf16_gemm_kernel())
    parts = [pack_gguf(random_blocks(q, n, 256, seed=n), q, n, 256) for q, n in ((QType.Q4_0, 64), (QType.Q8_0, 12))]
    weight = method.prepare(QuantizedWeight.stack(parts))
    assert [p.panels for p in weight.parts] == [True, False]
    x = torch.randn(24, 256).bfloat16()
    with torch.profiler.profile() as prof:
        got = method.matmul(weight, x)
    names = [e.name for e in prof.events()]
    assert names.count("twostep::quant_gemm_bf16") == 1 and names.count("twostep::quant_gemv") == 3
    assert "twostep::quant_dequantize_rows" not in names
    expected = x.float() @ torch.cat([p.dequantize() for p in parts]).t()
    torch.testing.assert_close(got.float(), expected, rtol=2 ** -7, atol=2e-2 * expected.abs().max().item())
