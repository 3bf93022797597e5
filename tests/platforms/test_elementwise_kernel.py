"""RMSNorm and rotary as one C++ call each (twostep/kernels/elementwise.cpp) against the PyTorch
code they replace, and the engine's use of them."""
from __future__ import annotations

import pytest
import torch

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


@pytest.mark.parametrize("shape", [(1, 896), (9, 576), (3, 14, 64)])
def test_bf16_rms_norm_is_within_one_rounding_of_the_torch_ops(shape):
    kernel = kernel_or_skip()
    g = torch.Generator().manual_seed(sum(shape))
    norm = RMSNorm(shape[-1], 1e-6)
    norm.weight.data = (torch.rand(shape[-1], generator=g) * 2).to(torch.bfloat16)
    x = (torch.randn(*shape, generator=g) * 5).to(torch.bfloat16)
    want = norm(x)
    assert norm.use(elementwise_op(kernel, "rms_norm", torch.bfloat16))
    got = norm(x)
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    diff = (got.float() - want.float()).abs()
    assert (diff <= want.float().abs() * 2 ** -7).all()         # one bf16 step at most
    assert (diff == 0).float().mean() > 0.95                    # and almost always none


class MustNotRun:
    def rms_norm(self, *args):
        raise AssertionError("the kernel ran on a float32 input")


def test_float32_rms_norm_keeps_the_torch_ops():
    norm = RMSNorm(64, 1e-5)
    x = torch.randn(4, 64)
    want = norm(x)
    norm.use(elementwise_op(MustNotRun(), "rms_norm", torch.float32))
    assert torch.equal(norm(x), want)


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
    assert engine.model.rotary.impl is kernel.rotary
    assert norms and all(m.impl is RMSNorm.forward_native for m in norms)     # float32: torch ops
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir("llama")), dtype="bfloat16",
                                    kv_cache_memory="4MiB"))
    assert engine.model.rotary.impl is kernel.rotary
    assert all(m.impl is kernel.rms_norm for m in engine.model.modules() if isinstance(m, RMSNorm))


def test_bf16_rms_norm_of_a_strided_view_as_qwen3s_q_norm():
    kernel = kernel_or_skip()
    qkv = torch.randn(5, 3 * 4 * 32).to(torch.bfloat16)
    q = qkv[:, : 4 * 32].view(5, 4, 32)                     # a view with a gap between tokens
    norm = RMSNorm(32, 1e-6)
    norm.weight.data = norm.weight.data.to(torch.bfloat16)
    want = norm(q.contiguous())
    norm.use(kernel.rms_norm)
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
