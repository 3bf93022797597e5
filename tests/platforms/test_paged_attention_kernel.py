"""The C++ paged decode-attention kernel against the PyTorch reference backend, and the engine
with each backend against transformers."""
from __future__ import annotations

import math

import pytest
import torch

from conftest import cpu_flags, engine_for, run_all
from twostep.attention.backend import HybridBackend
from twostep.attention.kv_layer_cache import KVLayerCache
from twostep.attention.metadata import AttentionMetadata
from twostep.attention.paged_decode import PagedDecode
from twostep.attention.reference import ReferenceDecode
from twostep.attention.selector import get_attention_backend
from twostep.config import kv_format
from twostep.platforms.cpu.paged_attention import paged_decode_attention


def kernel_or_skip():
    from twostep.kernels import paged_attention

    kernel = paged_attention()
    if kernel is None:
        pytest.skip("the C++ kernel cannot be built here (no g++ or ninja); the reference backend is used")
    return kernel


def test_bf16_scores_take_the_dot_products_where_the_cpu_has_them():
    """With AVX512-BF16 a bf16 cache's scores for bf16 queries come from vdpbf16ps (the build says so
    where the CPU has it), and the outputs stay within a bf16 rounding of the float32 path's on the
    same values (each product is exact in float32; only the order of the float32 sums differs)."""
    kernel = kernel_or_skip()
    if {"avx512f", "avx512_bf16"} <= cpu_flags():
        assert kernel.has_bf16_dot()
    # the instruction counts a subnormal input as zero: a query of 2^-130 against a key of 2^120 scores
    # 2^-10 (x 2^10 = 1) in float32 and 0 by the dot products, which tells which path ran
    for dim in (64, 48):                # 48: not a multiple of 32, the float32 path either way
        cache = torch.zeros(2, 2, 16, 1, dim)
        cache[0, 1, 0, 0, 0], cache[1, 1, 0, 0, :] = 2.0 ** 120, 1.0       # position 0's key and value
        q = torch.zeros(1, 2, dim)
        q[0, :, 0] = 2.0 ** -130
        plan = (torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, dtype=torch.int64), cache.bfloat16(),
                torch.tensor([[1]]), torch.tensor([16]), 2.0 ** 10)
        weight = kernel.paged_decode_attention(q.bfloat16(), *plan)[0, 0, 0, 0].item()
        dot = kernel.has_bf16_dot() and dim % 32 == 0
        assert weight == pytest.approx(1 / 16 if dot else math.e / (math.e + 15), rel=2 ** -7)
    g = torch.Generator().manual_seed(7)
    for dim, group, length in ((64, 7, 1000), (128, 4, 300), (64, 3, 17)):
        cache = torch.randn(2, 70, 16, 2, dim, generator=g).bfloat16()
        q = torch.randn(1, 2 * group, dim, generator=g).bfloat16()
        tables = torch.randperm(69, generator=g)[:-(-length // 16)].add(1).view(1, -1)
        args = (torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, dtype=torch.int64))
        got = kernel.paged_decode_attention(q, *args, cache, tables, torch.tensor([length]), dim ** -0.5)
        exact = kernel.paged_decode_attention(q.float(), *args, cache.float(), tables, torch.tensor([length]),
                                              dim ** -0.5)
        torch.testing.assert_close(got.float(), exact.bfloat16().float(), rtol=2 ** -7, atol=2 ** -12)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("block_size,group", [(16, 3), (1, 1), (4, 7)])
@pytest.mark.parametrize("dim", [64, 128, 40])     # the vector paths' head sizes, and the plain loops'
def test_kernel_matches_the_reference_decode(dtype, tol, block_size, group, dim):
    backend = PagedDecode(paged_decode_attention(kernel_or_skip(), dtype, False))
    g = torch.Generator().manual_seed(block_size * 10 + group)
    kv_heads = 2
    # decodes, and decodes verifying drafts; past 256 positions a context is split into parts
    # merged after (1000: four of 256, 256, 256, 232; 290 with 160 query rows: parts of 160 and
    # 130, so the first 30 rows see none of the second)
    lens = [300, 1, 17, 64, 129, 250, 1000, 257, 520, 290]
    qlens = [1, 1, 3, 1, 5, 2, 1, 3, 4, 160]
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + 1
    values = torch.randn(2, num_blocks, block_size, kv_heads, dim, generator=g).to(dtype)
    cache = KVLayerCache(values, None, kv_format("auto"))
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    tables, off = [], 0
    for n in need:
        tables.append(perm[off:off + n])
        off += n
    width = max(need)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    starts = [0]
    for q in qlens:
        starts.append(starts[-1] + q)
    q = torch.randn(starts[-1], kv_heads * group, dim, generator=g).to(dtype)
    common = AttentionMetadata(starts, qlens, lens, torch.empty(0, dtype=torch.int64), table,
                               block_size, [True] * len(lens))
    everyone = list(range(len(lens)))
    expected = torch.full_like(q, float("nan"))
    reference_decode = ReferenceDecode()
    reference_decode.forward(q, cache, reference_decode.build(common, everyone), dim ** -0.5, expected)
    got = torch.full_like(q, float("nan"))
    backend.forward(q, cache, backend.build(common, everyone), dim ** -0.5, got)  # drafts' queries too
    assert not got.isnan().any()
    assert (got.float() - expected.float()).abs().max() < tol
    single = backend.build(common, [0, 1, 3])
    got = torch.full_like(q, float("nan"))
    backend.forward(q, cache, single, dim ** -0.5, got)          # a subset of the rows
    rows = single.rows.index.reshape(-1)
    assert (got[rows].float() - expected[rows].float()).abs().max() < tol


@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 40])
def test_16bit_queries_give_the_float32_result_rounded(head_dim, q_dtype):
    """The kernel reads bf16 / fp16 queries into float32 and writes its output in their dtype:
    exactly a conversion before and after (the decode stack saves those two copies a layer); bf16
    queries whose scores take the AVX512-BF16 dot products (head size 64 here) within a bf16 step."""
    kernel = kernel_or_skip()
    g = torch.Generator().manual_seed(head_dim)
    cache = torch.randn(2, 6, 16, 2, head_dim, generator=g).to(torch.bfloat16)
    q = torch.randn(3, 6, head_dim, generator=g).to(q_dtype)
    # two sequences: the first verifies a draft (two query rows), the second decodes one (its row 1 is padding)
    plan = (torch.tensor([[0, 1], [2, 2]]), torch.tensor([2, 1]), cache, torch.tensor([[1, 3], [5, 0]]),
            torch.tensor([30, 9]))
    got = kernel.paged_decode_attention(q, *plan, 0.125)
    expected = kernel.paged_decode_attention(q.float(), *plan, 0.125)
    assert got.dtype == q_dtype and expected.dtype == torch.float32
    if q_dtype == torch.bfloat16 and head_dim % 32 == 0 and kernel.has_bf16_dot():
        torch.testing.assert_close(got.float(), expected.to(q_dtype).float(), rtol=2 ** -7, atol=2 ** -12)
    else:
        assert torch.equal(got, expected.to(q_dtype))
    assert got[1, 1].eq(0).all()                  # the padded row past q_len stays zero


@pytest.mark.parametrize("backend", ["reference", "auto"])
def test_engine_is_token_exact_with_each_backend(reference, backend):   # noqa: F811
    folder, prompts, expected = reference
    from twostep.kernels import paged_attention

    engine = engine_for(folder, attention_backend=backend, max_num_batched_tokens=40)
    uses_kernel = isinstance(engine.runner.backend.decode, PagedDecode)
    assert uses_kernel == (backend == "auto" and paged_attention() is not None)
    assert [o.outputs[0].token_ids for o in run_all(engine, prompts)] == expected


def test_backend_names():
    reference_backend = get_attention_backend("reference")
    assert isinstance(reference_backend, HybridBackend) and isinstance(reference_backend.decode, ReferenceDecode)
    with pytest.raises(ValueError, match="available"):
        get_attention_backend("flash")
