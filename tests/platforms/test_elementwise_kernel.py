"""RMSNorm, add + RMSNorm, SiLU-and-multiply, rotary and the K/V write as one C++ call each
(twostep/kernels/csrc/elementwise.cpp) against the PyTorch code they replace, and the engine's use of them."""
from __future__ import annotations

import pytest
import torch

from twostep.layers.activation import SiluAndMul
from twostep.layers.norm import RMSNorm
from twostep.layers.rotary import RopeTables, RotaryEmbedding, apply_rotary
from twostep.platforms.cpu.elementwise import elementwise_op


def kernel_or_skip():
    from twostep.kernels import elementwise

    kernel = elementwise()
    if kernel is None:
        pytest.skip("the elementwise kernel cannot be built here (no g++ or ninja)")
    return kernel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,heads,kv_heads,dim", [(1, 14, 2, 64), (37, 4, 4, 128), (5, 3, 1, 8)])
def test_rotary_is_bit_identical_to_the_torch_ops(dtype, tokens, heads, kv_heads, dim):
    kernel = kernel_or_skip()
    g = torch.Generator().manual_seed(tokens + heads + dim)
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g) * 3).to(dtype)
    q, k, _ = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k = q.view(tokens, heads, dim), k.view(tokens, kv_heads, dim)   # strided views, as in the model
    rope = RotaryEmbedding(dim, 10000.0, None, 4096, torch.device("cpu"))
    positions = torch.randint(0, 4096, (tokens,), generator=g)
    tables = rope.lookup(positions, dtype)
    want = apply_rotary(q, k, tables.cos, tables.sin)
    got = RopeTables(tables.cos, tables.sin, kernel.rotary).apply(q, k)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("shape", [(1, 896), (9, 576), (3, 14, 64), (2, 45)])   # 45: the vector loop's tail
def test_bf16_rms_norm_is_within_one_rounding_of_the_torch_ops(shape):
    kernel = kernel_or_skip()
    g = torch.Generator().manual_seed(sum(shape))
    norm = RMSNorm(shape[-1], 1e-6)
    norm.weight.data = (torch.rand(shape[-1], generator=g) * 2).to(torch.bfloat16)
    x = (torch.randn(*shape, generator=g) * 5).to(torch.bfloat16)
    want = norm(x)
    assert norm.use("rms_norm", elementwise_op(kernel, "rms_norm", torch.bfloat16))
    got = norm(x)
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    diff = (got.float() - want.float()).abs()
    assert (diff <= want.float().abs() * 2 ** -7).all()         # one bf16 step at most
    assert (diff == 0).float().mean() > 0.95                    # and almost always none


@pytest.mark.parametrize("shape", [(1, 576), (7, 896), (2, 3, 64), (3, 45)])
def test_float32_rms_norm_is_within_float_rounding_of_the_torch_ops(shape):
    kernel = kernel_or_skip()
    g = torch.Generator().manual_seed(sum(shape))
    norm = RMSNorm(shape[-1], 1e-5)
    norm.weight.data = torch.rand(shape[-1], generator=g) * 2
    x = torch.randn(*shape, generator=g) * 5
    want = norm(x)
    assert norm.use("rms_norm", elementwise_op(kernel, "rms_norm", torch.float32))
    got = norm(x)
    assert ((got - want).abs() <= want.abs() * 2 ** -22 + 1e-30).all()    # a few float32 ulps
    assert not torch.equal(norm(x * 2), got)                             # it computes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [576, 581])            # 581: the vector loops' tails
def test_add_rms_norm_updates_the_residual_exactly_and_normalises_the_sum(dtype, width):
    kernel = kernel_or_skip()
    g = torch.Generator().manual_seed(3)
    norm = RMSNorm(width, 1e-5)
    norm.weight.data = (torch.rand(width, generator=g) * 2).to(dtype)
    x, residual = (torch.randn(5, width, generator=g) * 3).to(dtype), torch.randn(5, width, generator=g).to(dtype)
    native_residual, kernel_residual = residual.clone(), residual.clone()
    want = norm(x, native_residual)
    assert torch.equal(native_residual, residual + x)
    norm.use("add_rms_norm", elementwise_op(kernel, "add_rms_norm", dtype))
    norm.use("rms_norm", elementwise_op(kernel, "rms_norm", dtype))
    got = norm(x, kernel_residual)
    assert torch.equal(kernel_residual, native_residual)                 # the add rounds as torch's
    assert torch.equal(got, norm(kernel_residual))                       # then the same norm
    tolerance = 2 ** -7 if dtype == torch.bfloat16 else 2 ** -22
    assert ((got.float() - want.float()).abs() <= want.float().abs() * tolerance + 1e-30).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 2 * 1536), (6, 2 * 100), (2, 3, 2 * 8)])
def test_silu_and_mul_matches_the_torch_ops(dtype, shape):
    from twostep.layers.activation import silu_and_mul_native

    kernel = kernel_or_skip()
    g = torch.Generator().manual_seed(shape[-1])
    x = (torch.randn(*shape, generator=g) * 6).to(dtype)
    x.view(-1)[:4] = torch.tensor([-100.0, 100.0, 0.0, -0.0]).to(dtype)     # saturation and zeros
    want = silu_and_mul_native(x)
    got = kernel.silu_and_mul(x)
    assert got.shape == want.shape and got.dtype == dtype
    tolerance = 2 ** -7 if dtype == torch.bfloat16 else 2 ** -20
    diff = (got.float() - want.float()).abs()
    assert (diff <= want.float().abs() * tolerance + 1e-30).all()
    assert (diff == 0).float().mean() > 0.5
    assert torch.isfinite(got).all()


@pytest.mark.parametrize("width", [1536, 100, 40, 17, 8, 3])
def test_bf16_silu_and_mul_rounds_the_float32_silu(width):
    """bf16 (vectors of 16 where the build has AVX-512, of 8, then a scalar tail): silu in float32
    rounded to bf16 (nearest even, NaN kept), times up, rounded again: the float32 kernel's silu,
    rounded by torch."""
    kernel = kernel_or_skip()
    g = torch.Generator().manual_seed(width)
    gate = (torch.randn(2, width, generator=g) * 6).to(torch.bfloat16)
    up = (torch.randn(2, width, generator=g) * 3).to(torch.bfloat16)
    gate.view(-1)[:3] = torch.tensor([float("nan"), float("inf"), -float("inf")]).to(torch.bfloat16)
    silu = kernel.silu_and_mul(torch.cat([gate.float(), torch.ones(2, width)], -1))
    want = (silu.to(torch.bfloat16).float() * up.float()).to(torch.bfloat16)
    got = kernel.silu_and_mul(torch.cat([gate, up], -1))
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(), want.nan_to_num())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_in_place_on_the_qkv_output_is_bit_identical(dtype):
    kernel = kernel_or_skip()
    tokens, heads, kv_heads, dim = 3, 6, 2, 64
    g = torch.Generator().manual_seed(9)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g).to(dtype)
    rope = RotaryEmbedding(dim, 10000.0, None, 512, torch.device("cpu"))
    tables = rope.lookup(torch.tensor([0, 17, 300]), dtype)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    want_q, want_k = apply_rotary(q.view(tokens, heads, dim), k.view(tokens, kv_heads, dim),
                                  tables.cos, tables.sin)
    want_v = v.clone()
    native = qkv.clone()
    RopeTables(tables.cos, tables.sin).apply_(native[:, :(heads + kv_heads) * dim].view(tokens, -1, dim))
    RopeTables(tables.cos, tables.sin, kernel.rotary, kernel.rotary_).apply_(
        qkv[:, :(heads + kv_heads) * dim].view(tokens, -1, dim))
    assert torch.equal(qkv, native)
    assert torch.equal(q.reshape(tokens, heads, dim), want_q) and torch.equal(k.reshape(tokens, kv_heads, dim), want_k)
    assert torch.equal(v, want_v)                                         # v untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_matches_index_copy(dtype):
    from twostep.attention.kv_layer_cache import KVLayerCache, write_kv
    from twostep.config import kv_format

    kernel = kernel_or_skip()
    g = torch.Generator().manual_seed(4)
    values = torch.randn(2, 5, 4, 2, 8, generator=g).to(dtype)
    qkv = torch.randn(3, (4 + 2 * 2) * 8, generator=g).to(dtype)
    k = qkv[:, 32:48].view(3, 2, 8)                                       # strided views, as in the model
    v = qkv[:, 48:].view(3, 2, 8)
    slots = torch.tensor([19, 0, 6])
    want = values.clone()
    write_kv(KVLayerCache(want, None, kv_format("auto")), k, v, slots)
    kernel.write_kv(values, k, v, slots)
    assert torch.equal(values, want)
    with pytest.raises(RuntimeError, match="out of range"):
        kernel.write_kv(values, k, v, torch.tensor([20, 0, 1]))
    with pytest.raises(RuntimeError, match="dtype"):
        kernel.write_kv(values, k.double(), v, slots)


def test_the_kernels_are_torch_custom_ops_the_profiler_sees():
    kernel = kernel_or_skip()
    x = torch.randn(2, 64)
    assert torch.equal(torch.ops.twostep.silu_and_mul(x), kernel.silu_and_mul(x))
    with torch.profiler.profile() as prof:
        kernel.rms_norm(x, torch.ones(64), 1e-6)
        torch.ops.twostep.add_rms_norm(x, x.clone(), torch.ones(64), 1e-6)
    names = {e.key for e in prof.key_averages()}
    assert {"twostep::rms_norm", "twostep::add_rms_norm"} <= names


def test_kernel_rejects_bad_shapes():
    kernel = kernel_or_skip()
    with pytest.raises(RuntimeError, match="hidden"):
        kernel.rms_norm(torch.randn(2, 8), torch.ones(7), 1e-6)
    with pytest.raises(RuntimeError, match="hidden"):
        kernel.rms_norm(torch.randn(2, 0), torch.ones(0), 1e-6)
    with pytest.raises(RuntimeError, match="even"):
        kernel.rotary(torch.randn(2, 1, 7), torch.randn(2, 1, 7), torch.randn(2, 1, 7))
    with pytest.raises(RuntimeError, match="cos/sin"):
        kernel.rotary(torch.randn(2, 1, 8), torch.randn(2, 1, 4), torch.randn(2, 1, 4))


def test_engine_uses_the_kernel_on_cpu(tiny_model_dir):
    from twostep import EngineConfig, LLMEngine

    kernel = kernel_or_skip()
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir("llama")), dtype="float32",
                                    kv_cache_memory="4MiB"))
    norms = [m for m in engine.model.modules() if isinstance(m, RMSNorm)]
    assert engine.model.rotary["global"].impls["rotary"] is kernel.rotary
    assert norms and all(m.impls["rms_norm"] is kernel.rms_norm and m.impls["add_rms_norm"] is kernel.add_rms_norm
                         for m in norms)
    assert all(m.impls["silu_and_mul"] is kernel.silu_and_mul for m in engine.model.modules()
               if isinstance(m, SiluAndMul))
    assert engine.runner.backend.write_values is kernel.write_kv
    assert engine.runner.sampler.argmax is kernel.first_argmax       # the greedy pick in one call
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir("llama")), dtype="bfloat16",
                                    kv_cache_memory="4MiB"))
    assert engine.model.rotary["global"].impls["rotary"] is kernel.rotary
    assert all(m.impls["rms_norm"] is kernel.rms_norm for m in engine.model.modules() if isinstance(m, RMSNorm))


def test_bf16_rms_norm_of_a_strided_view_as_qwen3s_q_norm():
    kernel = kernel_or_skip()
    qkv = torch.randn(5, 3 * 4 * 32).to(torch.bfloat16)
    q = qkv[:, : 4 * 32].view(5, 4, 32)                     # a view with a gap between tokens
    norm = RMSNorm(32, 1e-6)
    norm.weight.data = norm.weight.data.to(torch.bfloat16)
    want = norm(q.contiguous())
    norm.use("rms_norm", kernel.rms_norm)
    got = norm(q)
    assert ((got.float() - want.float()).abs() <= want.float().abs() * 2 ** -7).all()


def test_float16_on_cpu_keeps_the_torch_ops(tiny_model_dir):
    """The kernels cover float32 and bfloat16; a float16 model must still run (on the torch ops)."""
    from twostep import EngineConfig, LLMEngine, SamplingParams

    kernel_or_skip()
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir("llama")), dtype="float16",
                                    kv_cache_memory="4MiB"))
    engine.add_request([5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
    assert len(done[0].outputs[0].token_ids) == 3
