"""A float32 model's bf16-valued weights kept in bf16 (platforms/cpu/bf16_weights.py): the kernel's
float32 path against float32 math, which layers are narrowed, the tiles for many rows, and a bf16
checkpoint run in float32 end to end against transformers and against the engine without it."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import CountingKernel, hf_greedy, load_hf, make_tiny_model, random_prompts, run_all
from twostep import EngineConfig, LLMEngine, SamplingParams
from twostep.layers.linear import Linear
from twostep.platforms.cpu import bf16_weights
from twostep.platforms.cpu.bf16_weights import Bf16WeightsLinearMethod, holds_bf16_values


def kernel_or_skip():
    from twostep.kernels import linear_bf16

    kernel = linear_bf16()
    if kernel is None or not kernel.has_float32_path():
        pytest.skip("the matrix-vector kernel for bf16 weights needs g++/ninja")
    return kernel


def float32_math(x, w, b=None):
    """float64 sums of the float32 input and the widened weights: what float32 math approximates."""
    return x.double() @ w.double().T + (0 if b is None else b.double())


def assert_float32_close(got, x, w, b=None):
    want = float32_math(x, w, b)
    # float32 sums in some order: within a few float32 roundings of the sum of |terms|
    scale = (x.double().abs() @ w.double().abs().T) + (0 if b is None else b.double().abs())
    assert got.dtype == torch.float32
    assert ((got.double() - want).abs() <= 1e-6 * scale + 1e-30).all()


# K: multiples of 16 (the vector chunk), ragged tails, shorter than a chunk
@pytest.mark.parametrize("n,k", [(7, 33), (64, 896), (300, 70), (5, 4864), (33, 16), (3, 1), (9, 15)])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 9])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_float32_inputs_match_float32_math(n, k, m, bias):
    kernel = kernel_or_skip()
    g = torch.Generator().manual_seed(n * 1000 + k + m)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    b = torch.randn(n, generator=g) if bias else None
    got = kernel.linear_bf16(x, w, b)
    assert got.shape == (m, n)
    assert_float32_close(got, x, w, b)


def test_kernel_float32_inputs_reject_bad_input():
    kernel = kernel_or_skip()
    w = torch.randn(16, 40).to(torch.bfloat16)
    x = torch.randn(1, 2, 40)
    assert kernel.linear_bf16(x, w, None).shape == (1, 2, 16)
    with pytest.raises(RuntimeError, match="weight must be bfloat16"):
        kernel.linear_bf16(x, w.float(), None)
    with pytest.raises(RuntimeError, match="bfloat16 or float32"):
        kernel.linear_bf16(x.double(), w, None)
    with pytest.raises(RuntimeError, match="bias"):
        kernel.linear_bf16(x, w, torch.ones(16).to(torch.bfloat16))     # not the input's dtype
    with pytest.raises(RuntimeError, match="features"):
        kernel.linear_bf16(torch.randn(1, 39), w, None)
    assert kernel.linear_bf16(torch.empty(0, 40), w, None).shape == (0, 16)


def test_holds_bf16_values():
    w = torch.randn(300, 70)
    assert not holds_bf16_values(w)
    assert holds_bf16_values(w.to(torch.bfloat16).float())
    almost = w.to(torch.bfloat16).float()
    almost[-1, -1] = almost[-1, -1].item() + 2 ** -20          # one value off the bf16 grid
    assert not holds_bf16_values(almost)
    assert not holds_bf16_values(w.to(torch.bfloat16))          # not float32


def bound_linear(weight, bias=None):
    layer = Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    layer.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)
    if bias is not None:
        layer.bias = torch.nn.Parameter(bias.clone(), requires_grad=False)
    layer.set_method(Bf16WeightsLinearMethod(kernel_or_skip()))
    return layer


def test_method_narrows_bf16_valued_weights_and_routes_rows(monkeypatch):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(200, 48, generator=g).to(torch.bfloat16).float()
    b = torch.randn(200, generator=g)
    layer = bound_linear(w, b)
    assert layer.weight.dtype == torch.bfloat16 and torch.equal(layer.weight.float(), w)
    counter = CountingKernel(layer.method.kernel)
    layer.method.kernel = counter
    monkeypatch.setattr(bf16_weights, "TILE_BYTES", 48 * 4 * 64)     # tiles of 64 rows: 4 tiles, the last short
    for rows in (1, 4, 5, 33, bf16_weights.GEMV_MAX_ROWS, bf16_weights.GEMV_MAX_ROWS + 3):
        x = torch.randn(rows, 48, generator=g)
        calls = counter.calls
        got = layer(x)
        assert counter.calls - calls == (rows <= bf16_weights.GEMV_MAX_ROWS)
        assert_float32_close(got, x, w, b)
        if rows > bf16_weights.GEMV_MAX_ROWS:           # the tiles: F.linear on the widened weight
            assert torch.allclose(got, F.linear(x, w, b), rtol=0, atol=1e-5)


def test_method_keeps_float32_weights():
    w = torch.randn(20, 48)
    layer = bound_linear(w)
    assert layer.weight.dtype == torch.float32
    x = torch.randn(2, 48)
    assert torch.equal(layer(x), F.linear(x, w))


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    """A tiny qwen2 (q/k/v biases, tied embedding) saved in bf16: every weight a bf16 value."""
    folder = make_tiny_model(tmp_path_factory.mktemp("bf16"), "qwen2", tie_word_embeddings=True)
    load_hf(folder).to(torch.bfloat16).save_pretrained(folder)
    return folder


def engine(folder, gemv: bool) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(folder), dtype="float32", kv_cache_memory="8MiB", cpu_gemv=gemv))


def greedy(llm: LLMEngine, prompts, max_tokens=16):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [out.outputs[0].token_ids for out in run_all(llm, prompts, params)]


def test_bf16_checkpoint_in_float32_keeps_bf16_weights_and_matches(bf16_checkpoint):
    kernel_or_skip()
    narrow, wide = engine(bf16_checkpoint, True), engine(bf16_checkpoint, False)
    linears = [m for m in narrow.model.modules() if isinstance(m, Linear)]
    assert linears and all(m.weight.dtype == torch.bfloat16 for m in linears)
    assert narrow.model.model.embed_tokens.weight.dtype == torch.bfloat16          # tied: one table
    assert all(m.weight.dtype == torch.float32 for m in wide.model.modules() if isinstance(m, Linear))
    # the decode steps really take the kernel (the one-call decode stack runs the same op: below)
    counter = CountingKernel(linears[0].method.kernel)
    linears[0].method.kernel = counter
    narrow.model.fused_decode = None
    prompts = random_prompts([5, 17, 30], seed=4)
    tokens = greedy(narrow, prompts)
    assert counter.calls >= len(linears) * 15
    # the same tokens as the float32 weights in the engine and in transformers
    assert tokens == greedy(wide, prompts)
    hf = load_hf(bf16_checkpoint)
    assert tokens == [hf_greedy(hf, p, 16) for p in prompts]


def test_fused_decode_stack_runs_bf16_weights(bf16_checkpoint):
    kernel_or_skip()
    with_stack = engine(bf16_checkpoint, True)
    if with_stack.model.fused_decode is None:
        pytest.skip("the one-call decode stack is not built here")
    stack = with_stack.model.fused_decode
    assert stack.max_rows == bf16_weights.GEMV_MAX_ROWS      # every linear in bf16: the kernel's rows
    taken = []

    def counted(*args):
        out = stack(*args)
        taken.append(out is not None)
        return out

    with_stack.model.fused_decode = counted
    prompts = random_prompts([9, 21], seed=5)
    layers = engine(bf16_checkpoint, True)
    layers.model.fused_decode = None
    assert greedy(with_stack, prompts, max_tokens=24) == greedy(layers, prompts, max_tokens=24)
    assert sum(taken) >= 20                                   # the decode steps ran in the stack
