"""Every C++ kernel is also a torch custom op (torch.ops.twostep.*) that computes what its Python
entry computes, and the profiler names them in a real decode step of a quantized model."""
from __future__ import annotations

import pytest
import torch

from twostep import kernels
from twostep.quantization.quantize import quantize_weight


def built(module):
    if module is None:
        pytest.skip("the kernel cannot be built here (no g++ or ninja)")
    return module


def test_quant_ops_match_their_python_entry():
    kernel = built(kernels.quant_linear())
    g = torch.Generator().manual_seed(0)
    part = quantize_weight(torch.randn(40, 64, generator=g), "int4")
    x = torch.randn(3, 64, generator=g)
    args = (*part.planes(), part.fmt.bits, part.fmt.group, part.fmt.zero)
    want, got = torch.empty(3, 40), torch.empty(3, 40)
    kernel.gemv(x, *args, want)
    torch.ops.twostep.quant_gemv(x, *args, got)
    assert torch.equal(got, want)
    ids = torch.tensor([3, 0, 39])
    rows, op_rows = torch.empty(3, 64), torch.empty(3, 64)
    kernel.dequantize_rows(*args, ids, rows)
    torch.ops.twostep.quant_dequantize_rows(*args, ids, op_rows)
    assert torch.equal(rows, op_rows)
    portable = built(kernels.quant_linear_portable())     # its own namespace: both load in one process
    scalar = torch.empty(3, 40)
    torch.ops.twostep_portable.quant_gemv(x, *args, scalar)
    portable_out = torch.empty(3, 40)
    portable.gemv(x, *args, portable_out)
    assert torch.equal(scalar, portable_out)


def test_paged_attention_op_matches_its_python_entry():
    kernel = built(kernels.paged_attention())
    g = torch.Generator().manual_seed(1)
    cache = torch.randn(2, 4, 16, 2, 64, generator=g)
    q = torch.randn(2, 4, 64, generator=g)
    args = (q, torch.tensor([[0], [1]]), torch.tensor([1, 1]), cache, torch.tensor([[1, 2], [3, 0]]),
            torch.tensor([20, 9]), 0.125)
    assert torch.equal(torch.ops.twostep.paged_decode_attention(*args), kernel.paged_decode_attention(*args))


def test_a_quantized_decode_step_shows_its_kernels_in_the_profiler():
    from conftest import smollm_path
    from twostep import LLM, SamplingParams

    built(kernels.quant_linear())
    llm = LLM(str(smollm_path()), dtype="float32", kv_cache_memory="64MiB")
    engine = llm.engine
    engine.add_request([1, 2, 3, 4], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    engine.step()
    with torch.profiler.profile() as prof:
        engine.step()
    names = {e.key for e in prof.key_averages()}
    assert {"twostep::paged_decode_attention", "twostep::add_rms_norm", "twostep::quant_dequantize_rows"} <= names
    # the linears' quantized product: int16 or (a decode batch, by default) int8 activations
    assert names & {"twostep::quant_gemv", "twostep::quant_gemm_int8"}
    assert not names & {"aten::linear", "aten::mm", "aten::addmm"}     # no weight dequantized to a matmul


def test_paged_attention_refuses_a_plan_that_reaches_outside_the_cache():
    kernel = built(kernels.paged_attention())
    cache = torch.zeros(2, 4, 16, 2, 64)
    q = torch.randn(1, 4, 64)
    good = dict(q_index=torch.tensor([[0]]), q_lens=torch.tensor([1]), tables=torch.tensor([[1, 2]]),
                seq_lens=torch.tensor([20]))

    def call(**changes):
        a = {**good, **changes}
        return kernel.paged_decode_attention(q, a["q_index"], a["q_lens"], cache, a["tables"], a["seq_lens"], 0.1)

    assert call().shape == (1, 1, 4, 64)
    for changes, message in [({"seq_lens": torch.tensor([500])}, "block table's reach"),
                             ({"tables": torch.tensor([[1, 9]])}, "block id 9"),
                             ({"q_index": torch.tensor([[3]])}, "q_index"),
                             ({"q_lens": torch.tensor([2])}, "q_len")]:
        with pytest.raises(RuntimeError, match=message):
            call(**changes)


def test_quant_gemv_refuses_planes_that_do_not_fit_k():
    kernel = built(kernels.quant_linear())
    part = quantize_weight(torch.randn(8, 64), "int4")
    args = (part.fmt.bits, part.fmt.group, part.fmt.zero)
    with pytest.raises(RuntimeError, match="qs"):
        kernel.gemv(torch.randn(1, 128), *part.planes(), *args, torch.empty(1, 8))     # x longer than the rows
    with pytest.raises(RuntimeError, match="scales"):
        kernel.gemv(torch.randn(1, 64), part.qs, part.qh, part.scales[:4], part.mins, *args, torch.empty(1, 8))
