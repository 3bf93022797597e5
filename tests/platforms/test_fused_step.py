"""The fused per-layer ops of a step (one C++ call each for RMSNorm after the residual add, rotary
in place, SiLU-and-multiply and the K/V write: twostep/kernels/csrc/elementwise.cpp) against the same
engine on the PyTorch ops they replace, and proof that the fused path is the one that runs."""
from __future__ import annotations

import pytest
import torch

from conftest import run_all
from twostep import EngineConfig, LLMEngine, SamplingParams
from twostep.layers.custom_op import CustomOp

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [40, 41, 42],
           [7, 8, 9, 7, 8, 9, 7, 8, 9, 7, 8], list(range(60, 100))]


def kernel_or_skip():
    from twostep.kernels import elementwise

    if elementwise() is None:
        pytest.skip("the elementwise kernel cannot be built here (no g++ or ninja)")


def unfused(engine: LLMEngine) -> LLMEngine:
    """The same engine on PyTorch's ops: every CustomOp back to its native implementation, and
    every step through the Python layers (no one-call decode stack, which runs the kernels)."""
    engine.model.fused_decode = None
    for m in engine.model.modules():
        if isinstance(m, CustomOp):
            m.impls = dict(m.native_ops)
    engine.runner.backend.write_values = None
    return engine


def make(model_dir, dtype="float32", **kw) -> LLMEngine:
    # 8 tokens a step: the long prompts are prefilled in chunks beside the others' decodes
    return LLMEngine(EngineConfig(model=str(model_dir), dtype=dtype, kv_cache_memory="4MiB",
                                  max_num_batched_tokens=8, **kw))


def outputs(engine, params):
    return [(o.outputs[0].token_ids, [next(iter(lp.values())).logprob for lp in o.outputs[0].logprobs])
            for o in run_all(engine, PROMPTS, params)]


@pytest.mark.parametrize("arch", ARCHS)
def test_float32_fused_step_matches_the_torch_ops(tiny_model_dir, arch):
    kernel_or_skip()
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    fused = outputs(make(tiny_model_dir(arch)), params)
    plain = outputs(unfused(make(tiny_model_dir(arch))), params)
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(fused, plain):
        assert tokens == want_tokens
        assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs)) < 1e-4


@pytest.mark.parametrize("extra", [
    {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
                            "prompt_lookup_min": 1}},
    {"enable_prefix_caching": True},
])
def test_fused_step_with_speculative_verification_and_prefix_caching(tiny_model_dir, extra):
    kernel_or_skip()
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    fused = outputs(make(tiny_model_dir("llama"), **extra), params)
    plain = outputs(unfused(make(tiny_model_dir("llama"), **extra)), params)
    assert [t for t, _ in fused] == [t for t, _ in plain]
    for (_, logprobs), (_, want) in zip(fused, plain):
        assert max(abs(a - b) for a, b in zip(logprobs, want)) < 1e-4


def test_fused_step_with_an_8bit_kv_cache(tiny_model_dir):
    """int8 codes on a rounding boundary may flip with a last-bit change upstream, so the bound
    is the cache's own quantisation noise, not float rounding."""
    kernel_or_skip()
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    fused = outputs(make(tiny_model_dir("llama"), kv_cache_dtype="int8"), params)
    plain = outputs(unfused(make(tiny_model_dir("llama"), kv_cache_dtype="int8")), params)
    agree = sum(a == b for (t, _), (u, _) in zip(fused, plain) for a, b in zip(t, u))
    assert agree >= 0.9 * sum(len(t) for t, _ in plain)
    first = [lp[0] - want[0] for (_, lp), (_, want) in zip(fused, plain)]
    assert max(map(abs, first)) < 1e-2


def test_bf16_fused_step_is_within_bf16_rounding(tiny_model_dir):
    kernel_or_skip()
    engine, reference = make(tiny_model_dir("qwen2"), "bfloat16"), unfused(make(tiny_model_dir("qwen2"), "bfloat16"))
    ids = torch.tensor(PROMPTS[3])
    logits = [_prefill_logits(e, ids) for e in (engine, reference)]
    assert (logits[0] - logits[1]).abs().max() < 0.1 * logits[1].abs().max()      # bf16: ~3 significant digits
    assert (logits[0].argmax(-1) == logits[1].argmax(-1)).float().mean() > 0.9


def _prefill_logits(engine, ids):
    from twostep.core.scheduling.scheduler_output import SchedulerOutput

    engine.add_request(ids.tolist(), SamplingParams(max_tokens=1))
    scheduler_output: SchedulerOutput = engine.scheduler.schedule()
    return engine.runner.all_logits(scheduler_output.plan).float()


def test_a_decode_step_runs_the_fused_kernels_not_the_torch_ops(tiny_model_dir):
    kernel_or_skip()
    engine = make(tiny_model_dir("llama"))
    engine.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    engine.step()                                           # the prefill
    with torch.profiler.profile() as prof:
        engine.step()                                       # one decode step
    names = {e.key for e in prof.key_averages()}
    assert {"twostep::add_rms_norm", "twostep::rms_norm", "twostep::rotary_", "twostep::silu_and_mul",
            "twostep::write_kv"} <= names
    assert not names & {"aten::silu", "aten::index_copy_", "aten::rms_norm", "aten::add_"}
