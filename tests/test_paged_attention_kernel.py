"""The C++ paged decode-attention kernel against the PyTorch reference backend, and the engine
with each backend against transformers."""
from __future__ import annotations

import pytest
import torch

from test_models import engine_for
from test_scheduling import reference, run_all  # noqa: F401  (reference is a fixture)
from twostep.layers.attention import DecodeBatch, ReferenceAttention, get_attention_backend
from twostep.layers.kv_storage import KVLayerCache, kv_format


def kernel_or_skip():
    from twostep.kernels import paged_attention

    kernel = paged_attention()
    if kernel is None:
        pytest.skip("the C++ kernel cannot be built here (no g++ or ninja); the reference backend is used")
    return kernel


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("block_size,group", [(16, 3), (1, 1), (4, 7)])
def test_kernel_matches_the_reference_decode(dtype, tol, block_size, group):
    from twostep.layers.cpu_paged_attention import CPUPagedAttention

    backend = CPUPagedAttention(kernel_or_skip())
    g = torch.Generator().manual_seed(block_size * 10 + group)
    kv_heads, dim = 2, 64
    lens = [300, 1, 17, 64, 129, 250]
    qlens = [1, 1, 3, 1, 5, 2]                    # decodes, and decodes verifying drafts
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
    batch = DecodeBatch.build(list(range(len(lens))), starts, qlens, lens, table, block_size)
    expected = torch.full_like(q, float("nan"))
    ReferenceAttention()._decode(q, cache, batch, dim ** -0.5, expected)
    got = torch.full_like(q, float("nan"))
    backend.kernel_decode(q, cache, batch, dim ** -0.5, got)    # drafts' queries too
    assert not got.isnan().any()
    assert (got.float() - expected.float()).abs().max() < tol
    single = DecodeBatch.build([0, 1, 3], starts, qlens, lens, table, block_size)
    got = torch.full_like(q, float("nan"))
    backend._decode(q, cache, single, dim ** -0.5, got)          # what the engine calls
    rows = single.index.reshape(-1)
    assert (got[rows].float() - expected[rows].float()).abs().max() < tol


@pytest.mark.parametrize("backend", ["reference", "auto"])
def test_engine_is_token_exact_with_each_backend(reference, backend):   # noqa: F811
    folder, prompts, expected = reference
    from twostep.kernels import paged_attention
    from twostep.layers.cpu_paged_attention import CPUPagedAttention

    engine = engine_for(folder, attention_backend=backend, max_num_batched_tokens=40)
    uses_kernel = isinstance(engine.runner.backend, CPUPagedAttention)
    assert uses_kernel == (backend == "auto" and paged_attention() is not None)
    assert [o.outputs[0].token_ids for o in run_all(engine, prompts)] == expected


def test_backend_names():
    assert isinstance(get_attention_backend("reference"), ReferenceAttention)
    with pytest.raises(ValueError, match="available"):
        get_attention_backend("flash")
