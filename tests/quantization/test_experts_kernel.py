"""The CPU experts kernel (kernels/csrc/quant/experts.cpp via platforms/cpu/experts.py) against the
experts in torch over the dequantized weights (layers/moe.py's TorchExperts), for every packed
type, both layouts, the two activations with and without biases, and 1 to 64 rows."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from twostep import kernels
from twostep.layers.moe import Experts, TorchExperts, route
from twostep.models.config import ModelConfig
from twostep.platforms.cpu.experts import QuantizedExperts
from twostep.platforms.cpu.quant_linear import QuantizedLinearMethod
from twostep.quantization.gguf_blocks import PACKED_TYPES, pack_gguf
from twostep.quantization.packed import QuantizedWeight

from test_quant_kernel import GEMV_RTOL, INT8_RTOL, random_blocks

E, TOP_K, HIDDEN, INTER = 8, 2, 256, 256        # K-quants: rows of whole 256-weight super-blocks

BASE = ModelConfig(architecture="test", vocab_size=8, hidden_size=HIDDEN, intermediate_size=INTER, num_layers=1,
                   num_heads=1, num_kv_heads=1, head_dim=8, rms_norm_eps=1e-6, rope_theta=1e4,
                   max_position_embeddings=8, tie_word_embeddings=False, num_experts=E,
                   num_experts_per_tok=TOP_K, moe_intermediate_size=INTER)
ACTS = {"silu": BASE, "swiglu_oai": dataclasses.replace(BASE, hidden_act="swiglu_oai", swiglu_limit=7.0,
                                                        expert_bias=True)}


def kernel():
    k = kernels.quant_linear()
    if k is None:
        pytest.skip("the quantized kernel needs g++ and ninja")
    return k


def blocks(qtype, n: int, k: int, seed: int) -> np.ndarray:
    """Random blocks; MXFP4's exponent bytes those of real weights' scales (2**-10 .. 2**-3), so the
    clamped SwiGLU's limit is not where int16 rounding of huge activations decides."""
    raw = random_blocks(qtype, n, k, seed)
    if qtype.name == "MXFP4":
        raw.reshape(-1, 17)[:, 0] = np.random.default_rng(seed).integers(118, 126, raw.size // 17)
    return raw


def quantized_experts(qtype, cfg: ModelConfig, seed: int) -> tuple[Experts, Experts]:
    """(experts with packed weights, the same experts dequantized to float32)."""
    packed, plain = Experts(cfg), Experts(cfg)
    for i, name in enumerate(("gate_proj", "up_proj", "down_proj")):
        proj, ref = getattr(packed, name), getattr(plain, name)
        n, k = proj.out_features, proj.in_features
        weight = QuantizedWeight((pack_gguf(blocks(qtype, n, k, seed + i), qtype, n, k),))
        proj.weight, proj.quantized = None, weight
        ref.weight = torch.nn.Parameter(weight.dequantize(), requires_grad=False)
        if proj.bias is not None:
            bias = torch.randn(n, generator=torch.Generator().manual_seed(seed + 10 + i)) * 0.1
            proj.bias = ref.bias = torch.nn.Parameter(bias, requires_grad=False)
    return packed, plain


def bind(packed: Experts, method: QuantizedLinearMethod, panels: bool) -> None:
    for proj in (packed.gate_proj, packed.up_proj, packed.down_proj):
        if panels:
            proj.quantized = method.prepare(proj.quantized)
        proj.set_method(method)
    packed.set_method(QuantizedExperts(method))


def routed(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, HIDDEN, generator=g)
    weights, ids = route(torch.randn(rows, E, generator=g), TOP_K, "softmax_topk", renormalise=True)
    return x, weights, ids


CASES = [(q, act) for q in PACKED_TYPES for act in ACTS]


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 64])
@pytest.mark.parametrize("panels", [False, True], ids=["rows", "panels"])
@pytest.mark.parametrize("qtype,act", CASES, ids=[f"{q.name}-{a}" for q, a in CASES])
def test_experts_kernel_matches_torch_on_the_dequantized_weights(qtype, act, panels, rows):
    method = QuantizedLinearMethod(kernel())
    packed, plain = quantized_experts(qtype, ACTS[act], seed=rows)
    bind(packed, method, panels)
    x, weights, ids = routed(rows, seed=rows + 1)
    expected = TorchExperts().apply(plain, x, weights, ids)
    got = packed(x, weights, ids)
    scale = expected.abs().max().item()
    # two products in a row, each with int16 activations (the down product's from the first's output)
    torch.testing.assert_close(got, expected, rtol=0, atol=4 * GEMV_RTOL * scale)


@pytest.mark.parametrize("rows", [1, 3, 64])
@pytest.mark.parametrize("qtype", [q for q in PACKED_TYPES], ids=lambda q: q.name)
def test_int8_activations_in_the_experts(qtype, rows):
    k = kernel()
    if not k.has_int8():
        pytest.skip(f"the {k.path()} build has no int8 product")
    method = QuantizedLinearMethod(k, int8_activations="all")
    packed, plain = quantized_experts(qtype, BASE, seed=rows)
    bind(packed, method, panels=True)
    x, weights, ids = routed(rows, seed=rows + 1)
    expected = TorchExperts().apply(plain, x, weights, ids)
    got = packed(x, weights, ids)
    torch.testing.assert_close(got, expected, rtol=0, atol=3 * INT8_RTOL * expected.abs().max().item())


def test_a_row_is_the_same_whatever_the_batch():
    """A decode row's output does not depend on the rows beside it (the experts run per row set, the
    sums in slot order)."""
    method = QuantizedLinearMethod(kernel())
    packed, _ = quantized_experts(PACKED_TYPES[0], BASE, seed=5)
    bind(packed, method, panels=True)
    x, weights, ids = routed(16, seed=6)
    alone = torch.cat([packed(x[i:i + 1], weights[i:i + 1], ids[i:i + 1]) for i in range(16)])
    assert torch.equal(packed(x, weights, ids), alone)


def test_bf16_rows():
    method = QuantizedLinearMethod(kernel())
    packed, _ = quantized_experts(PACKED_TYPES[0], BASE, seed=7)
    bind(packed, method, panels=True)
    x, weights, ids = routed(4, seed=8)
    got = packed(x.bfloat16(), weights, ids)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), packed(x.bfloat16().float(), weights, ids), rtol=2 ** -7, atol=1e-3)


def test_bad_expert_ids_are_refused():
    method = QuantizedLinearMethod(kernel())
    packed, _ = quantized_experts(PACKED_TYPES[0], BASE, seed=9)
    bind(packed, method, panels=False)
    x, weights, ids = routed(2, seed=10)
    ids[1, 0] = E
    with pytest.raises(RuntimeError, match="out of range"):
        packed(x, weights, ids)
