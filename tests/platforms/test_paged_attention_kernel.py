"""The C++ paged decode-attention kernel against the PyTorch reference backend, its per-layer
options (sliding window, soft cap, sinks) against attention written out in float32, and the engine
with each backend against transformers."""
from __future__ import annotations

import math

import pytest
import torch

from conftest import cpu_flags, engine_for, run_all
from twostep.attention.backend import HybridBackend
from twostep.attention.kv_layer_cache import KVLayerCache
from twostep.attention.metadata import AttentionMetadata
from twostep.attention.options import AttentionOptions
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


# a layer's options besides the scale: none, and a sliding window with soft-capping and sinks
# (gpt-oss's sinks, Gemma 2's cap and window together: every variant in one)
OPTIONS = {"plain": {}, "window-softcap-sinks": dict(window=100, softcap=30.0, sinks=True)}


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("block_size,group", [(16, 3), (1, 1), (4, 7)])
@pytest.mark.parametrize("dim", [64, 128, 40])     # the vector paths' head sizes, and the plain loops'
@pytest.mark.parametrize("variant", OPTIONS)
def test_kernel_matches_the_reference_decode(dtype, tol, block_size, group, dim, variant):
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
    settings = dict(OPTIONS[variant])
    if settings.pop("sinks", False):
        settings["sinks"] = torch.rand(kv_heads * group, generator=g) * 4 - 2
    options = AttentionOptions(dim ** -0.5, **settings)
    expected = torch.full_like(q, float("nan"))
    reference_decode = ReferenceDecode()
    reference_decode.forward(q, cache, reference_decode.build(common, everyone), options, expected)
    got = torch.full_like(q, float("nan"))
    backend.forward(q, cache, backend.build(common, everyone), options, got)  # drafts' queries too
    assert not got.isnan().any()
    assert (got.float() - expected.float()).abs().max() < tol
    single = backend.build(common, [0, 1, 3])
    got = torch.full_like(q, float("nan"))
    backend.forward(q, cache, single, options, got)          # a subset of the rows
    rows = single.rows.index.reshape(-1)
    assert (got[rows].float() - expected[rows].float()).abs().max() < tol


def attention_reference(q, q_index, q_lens, cache, tables, seq_lens, scale, window=0, softcap=0.0, sinks=None):
    """The kernel's result in plain float32 PyTorch, one sequence at a time: its visible K/V gathered
    from the block table (only positions some query sees: from the first query's window on), scores
    scaled, soft-capped, masked (causal and window), a sinks column joining the softmax, the weighted
    sum of V. [B, Q, H, D] float32, rows past a sequence's q_len zero."""
    batch, max_q = q_index.shape
    heads, dim = q.shape[1], q.shape[2]
    block_size, kv_heads = cache.shape[2], cache.shape[3]
    out = torch.zeros(batch, max_q, heads, dim)
    for b in range(batch):
        n, nq = int(seq_lens[b]), int(q_lens[b])
        first = max(0, n - nq - window + 1) if window else 0
        keys_at = torch.arange(first, n)
        slots = tables[b, keys_at // block_size], keys_at % block_size
        k = cache[0][slots].float().repeat_interleave(heads // kv_heads, dim=1)   # [L, H, D]
        v = cache[1][slots].float().repeat_interleave(heads // kv_heads, dim=1)
        queries = q[q_index[b, :nq]].float()                                        # [nq, H, D]
        scores = torch.einsum("qhd,lhd->hql", queries, k) * scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        at = torch.arange(n - nq, n)[:, None]                                       # query positions
        seen = keys_at[None, :] <= at
        if window:
            seen &= keys_at[None, :] > at - window
        scores = scores.masked_fill(~seen, float("-inf"))
        if sinks is not None:
            scores = torch.cat([scores, sinks.float().view(heads, 1, 1).expand(heads, nq, 1)], dim=-1)
        probs = torch.softmax(scores, dim=-1)[..., :len(keys_at)]
        out[b, :nq] = torch.einsum("hql,lhd->qhd", probs, v)
    return out


def sequences(lens, qlens, block_size, kv_heads, dim, dtype, g, spare=1):
    """A cache holding the sequences' blocks in random places (block 0 and `spare` - 1 more left
    over) and their tables (padded with 0); the plan's tensors for the kernel."""
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + spare
    cache = torch.randn(2, num_blocks, block_size, kv_heads, dim, generator=g).to(dtype)
    perm = (torch.randperm(num_blocks - spare, generator=g) + spare).tolist()
    rows, off = [], 0
    for n in need:
        rows.append(perm[off:off + n])
        off += n
    tables = torch.tensor([t + [0] * (max(need) - len(t)) for t in rows])
    starts = torch.tensor([0, *qlens]).cumsum(0)
    max_q = max(qlens)
    # each sequence's query rows, padded with its last
    q_index = torch.tensor([[int(starts[b]) + min(i, q - 1) for i in range(max_q)] for b, q in enumerate(qlens)])
    return cache, tables, q_index, torch.tensor(qlens), torch.tensor(lens)


# contexts of 1 position, under a tile, past 256 (split in two) and past 512 (three parts); one
# query each, and sequences verifying 1..3 drafts (2..4 queries), mixed in one batch
KERNEL_LENS = [1, 17, 300, 700, 4, 17, 300, 700, 2, 300]
KERNEL_QLENS = [1, 1, 1, 1, 4, 3, 2, 4, 2, 3]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("dim", [64, 128, 256, 80])   # the vector paths' sizes, Gemma's 256, an odd one
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("block_size", [4, 16])
def test_kernel_options_match_a_plain_reference(dtype, tol, dim, group, block_size):
    """Sliding windows, soft-capping and sinks, alone and together, on every head size's path and
    on contexts split into parts, against attention written out in float32."""
    kernel = kernel_or_skip()
    g = torch.Generator().manual_seed(dim * 100 + group * 10 + block_size)
    kv_heads = 2
    cache, tables, q_index, q_lens, seq_lens = sequences(KERNEL_LENS, KERNEL_QLENS, block_size, kv_heads, dim,
                                                         dtype, g)
    q = torch.randn(sum(KERNEL_QLENS), kv_heads * group, dim, generator=g).to(dtype)
    sinks = torch.rand(kv_heads * group, generator=g) * 4 - 2
    scale = 2 * dim ** -0.5             # scores of a few times 2 (and a float32 result within 1e-5)
    plan = (q, q_index, q_lens, cache, tables, seq_lens, scale)
    for window in (0, 1, 7, 64, 256, 512):
        for softcap in (0.0, 50.0, 30.0):
            for sink in (None, sinks):
                got = kernel.paged_decode_attention(*plan, window, softcap, sink)
                assert got.dtype == dtype and got.shape == (len(KERNEL_LENS), max(KERNEL_QLENS), kv_heads * group, dim)
                expected = attention_reference(*plan, window, softcap, sink)
                error = (got.float() - expected).abs().max().item()
                assert error < tol, (window, softcap, sink is not None, error)
    # the defaults are no options, bit for bit as named
    assert torch.equal(kernel.paged_decode_attention(*plan), kernel.paged_decode_attention(*plan, 0, 0.0, None))
    assert torch.equal(kernel.paged_decode_attention(*plan),
                       torch.ops.twostep.paged_decode_attention(*plan, window=0, softcap=0.0, sinks=None))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [4, 16])
def test_a_window_never_reads_what_it_cannot_see(dtype, block_size):
    """Positions before a sequence's first query's window are never read: their blocks' table
    entries point at a block of NaNs, or past the cache (freed, not checked), and the positions
    before the window in its first block are NaNs too; the outputs stay finite and right."""
    kernel = kernel_or_skip()
    g = torch.Generator().manual_seed(block_size)
    kv_heads, group, dim = 2, 3, 64
    lens, qlens = [700, 300, 40, 5, 300, 700], [1, 4, 2, 1, 1, 3]
    cache, tables, q_index, q_lens, seq_lens = sequences(lens, qlens, block_size, kv_heads, dim, dtype, g, spare=2)
    cache[:, 1] = float("nan")                   # block 1: NaNs, for the tables' entries before a window
    q = torch.randn(sum(qlens), kv_heads * group, dim, generator=g).to(dtype)
    sinks = torch.rand(kv_heads * group, generator=g) * 4 - 2
    for window in (1, 7, 64, 256, 512):
        poisoned, bad = cache.clone(), tables.clone()
        for b, (n, nq) in enumerate(zip(lens, qlens)):
            first = max(0, n - nq - window + 1)
            for j in range(first // block_size):     # blocks wholly before the window
                bad[b, j] = 1 if j % 2 else 10 ** 9
            # the positions before the window in the block it starts in
            poisoned[:, tables[b, first // block_size], : first % block_size] = float("nan")
        for softcap, sink in ((0.0, None), (30.0, sinks)):
            got = kernel.paged_decode_attention(q, q_index, q_lens, poisoned, bad, seq_lens, 0.125, window, softcap,
                                                sink)
            assert got.isfinite().all(), window
            expected = attention_reference(q, q_index, q_lens, cache, tables, seq_lens, 0.125, window, softcap, sink)
            assert (got.float() - expected).abs().max() < (1e-5 if dtype == torch.float32 else 2e-2), window
    # without a window every entry is followed, and checked
    with pytest.raises(RuntimeError, match="out of range"):
        kernel.paged_decode_attention(q, q_index, q_lens, cache, bad, seq_lens, 0.125)


def test_sinks_count_once_across_a_split_context():
    """A sink's weight does not depend on how a context is split: a sink far above every score takes
    nearly all the weight (the output shrinks towards zero by the same factor whether the context is
    one part or three), and a sink of -inf is no sink."""
    kernel = kernel_or_skip()
    g = torch.Generator().manual_seed(3)
    dim = 64
    for length in (200, 700):
        cache, tables, q_index, q_lens, seq_lens = sequences([length], [1], 16, 1, dim, torch.float32, g)
        q = torch.randn(1, 2, dim, generator=g)
        plan = (q, q_index, q_lens, cache, tables, seq_lens, 0.125)
        plain = kernel.paged_decode_attention(*plan)
        for sink in (torch.tensor([5.0, -1.0]), torch.tensor([float("-inf"), 0.5])):
            got = kernel.paged_decode_attention(*plan, sinks=sink)
            expected = attention_reference(*plan, sinks=sink)
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
        assert torch.equal(kernel.paged_decode_attention(*plan, sinks=torch.full((2,), float("-inf"))), plain)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_soft_cap_that_bites(dtype):
    """Scores far past the cap (a tiny model's cap of 5, scores of a few times 8): the capped softmax
    is far flatter than the plain one, and still the reference's, split context or not."""
    kernel = kernel_or_skip()
    g = torch.Generator().manual_seed(5)
    cache, tables, q_index, q_lens, seq_lens = sequences([40, 700, 300], [2, 1, 3], 16, 2, 64, dtype, g)
    q = torch.randn(6, 4, 64, generator=g).to(dtype)
    plan = (q, q_index, q_lens, cache, tables, seq_lens, 1.0)
    got = kernel.paged_decode_attention(*plan, softcap=5.0).float()
    assert (got - kernel.paged_decode_attention(*plan).float()).abs().max() > 0.1
    expected = attention_reference(*plan, softcap=5.0)
    assert (got - expected).abs().max() < (1e-5 if dtype == torch.float32 else 2e-2)


def test_options_are_checked():
    kernel = kernel_or_skip()
    cache = torch.randn(2, 2, 16, 1, 64)
    plan = (torch.randn(1, 2, 64), torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, dtype=torch.int64), cache,
            torch.tensor([[1]]), torch.tensor([5]), 0.125)
    for bad in (dict(window=-1), dict(softcap=-1.0), dict(sinks=torch.zeros(3)), dict(sinks=torch.zeros(2).double())):
        with pytest.raises(RuntimeError):
            kernel.paged_decode_attention(*plan, **bad)


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
