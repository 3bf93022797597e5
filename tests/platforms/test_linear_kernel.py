"""The C++ bf16 matrix-vector kernel (twostep/kernels/csrc/linear_bf16.cpp) against float32 math and
oneDNN, its routing in PackedLinear, and the engine's bf16 decode with and without it."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import CountingKernel, random_prompts
from twostep import EngineConfig, LLMEngine, SamplingParams
from twostep.layers.linear import Linear
from twostep.platforms.cpu.linear import GEMV_MAX_ROWS, PackedLinearMethod, can_prepack, packed_linear


def kernel_or_skip():
    from twostep.kernels import linear_bf16

    kernel = linear_bf16()
    if kernel is None or not kernel.has_bf16_dot():
        pytest.skip("the bf16 matrix-vector kernel needs g++/ninja and an AVX512-BF16 CPU")
    return kernel


def exact(x, w, b=None):
    """float32 products of the bf16 inputs, rounded once to bf16: what the kernel should give."""
    y = x.float() @ w.float().T + (0 if b is None else b.float())
    return y.to(torch.bfloat16)


# K: multiples of 64 (the unrolled loop), of 32 only (one single chunk), and ragged tails.
@pytest.mark.parametrize("n,k", [(7, 33), (64, 896), (300, 70), (5, 4864), (33, 32), (3, 1)])
@pytest.mark.parametrize("m", [1, 2, 3, 5])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_matches_float32_math(n, k, m, bias):
    kernel = kernel_or_skip()
    g = torch.Generator().manual_seed(n * 1000 + k + m)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    b = torch.randn(n, generator=g).to(torch.bfloat16) if bias else None
    got = kernel.linear_bf16(x, w, b)
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    want = exact(x, w, b)
    # float32 sums in another order: at most one bf16 rounding step apart
    ulp = want.float().abs().clamp_min(1e-2) * 2 ** -7
    assert ((got.float() - want.float()).abs() <= ulp).all()
    # and as close to oneDNN as oneDNN is to exact math
    assert (got.float() - F.linear(x, w, b).float()).abs().max() <= 2 * ulp.max()


def test_kernel_keeps_leading_dimensions_and_rejects_bad_input():
    kernel = kernel_or_skip()
    w = torch.randn(16, 40).to(torch.bfloat16)
    x = torch.randn(1, 2, 40).to(torch.bfloat16)
    assert kernel.linear_bf16(x, w, None).shape == (1, 2, 16)
    with pytest.raises(RuntimeError, match="bfloat16 or float32"):
        kernel.linear_bf16(x.half(), w, None)
    with pytest.raises(RuntimeError, match="weight must be bfloat16"):
        kernel.linear_bf16(x, w.float(), None)
    with pytest.raises(RuntimeError, match="features"):
        kernel.linear_bf16(torch.randn(1, 39).to(torch.bfloat16), w, None)
    with pytest.raises(RuntimeError, match="contiguous"):
        kernel.linear_bf16(x, w.t(), None)
    with pytest.raises(RuntimeError, match="bias"):
        kernel.linear_bf16(x, w, torch.ones(15).to(torch.bfloat16))
    assert kernel.linear_bf16(torch.empty(0, 40, dtype=torch.bfloat16), w, None).shape == (0, 16)


def test_packed_linear_routes_few_rows_to_the_kernel():
    kernel = kernel_or_skip()
    if not can_prepack(torch.bfloat16, torch.device("cpu")):
        pytest.skip("this CPU has no native bf16 in oneDNN")
    w = torch.randn(48, 96).to(torch.bfloat16)
    layer = packed_linear(w, gemv=kernel)
    plain = packed_linear(w)
    for rows in (1, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 1, 17):
        x = torch.randn(rows, 96).to(torch.bfloat16)
        want = kernel.linear_bf16(x, w, None) if rows <= GEMV_MAX_ROWS else plain(x)
        assert torch.equal(layer(x), want)


def decode_logits(folder, gemv: bool, dtype="bfloat16"):
    """Logits of the first decode step of one request (one row per linear: the kernel's case)."""
    engine = LLMEngine(EngineConfig(model=str(folder), dtype=dtype, kv_cache_memory="4MiB",
                                    cpu_gemv=gemv, enable_prefix_caching=False))
    layers = [m for m in engine.model.modules()
              if isinstance(m, Linear) and isinstance(m.method, PackedLinearMethod)]
    assert all((m.method.gemv is not None) == gemv for m in layers)
    counter = CountingKernel(layers[0].method.gemv) if gemv else None
    for method in {id(m.method): m.method for m in layers}.values():
        method.gemv = counter
    engine.model.fused_decode = None               # the layers' own calls, counted (the one-call decode
    #                                                stack runs the same op: tests/models/test_fused_decode.py)
    engine.add_request(random_prompts([23], seed=9)[0],
                       SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    engine.step()                                  # prefill: many rows, oneDNN (and the lm_head row)
    calls = counter.calls if gemv else 0
    logits = engine.runner.all_logits(engine.scheduler.schedule().plan)
    if gemv:                                       # the decode step's linears all took the kernel
        assert counter.calls - calls == len(layers)
    return logits


def test_engine_bf16_decode_with_the_kernel_stays_within_bf16_rounding(tiny_model_dir):
    kernel_or_skip()
    if not can_prepack(torch.bfloat16, torch.device("cpu")):
        pytest.skip("this CPU has no native bf16 in oneDNN")
    folder = tiny_model_dir("qwen2")   # with q/k/v biases
    # (with this tiny model's short rows, kernel and oneDNN often round to the same bf16)
    with_kernel, with_onednn = decode_logits(folder, True), decode_logits(folder, False)
    reference = decode_logits(folder, False, dtype="float32")
    kernel_err = (with_kernel - reference).abs().mean().item()
    onednn_err = (with_onednn - reference).abs().mean().item()
    # both are bf16 runs of the same math: neither may stray much further from float32 than the other
    print(f"mean |logit - float32|: kernel {kernel_err:.4f}, oneDNN {onednn_err:.4f}")
    assert kernel_err <= 1.5 * onednn_err + 1e-3
