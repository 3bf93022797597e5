"""8-bit KV cache: quantiser error bounds, logits and greedy agreement, capacity, and the
scheduler's features on quantised blocks."""
from __future__ import annotations

import pytest
import torch

from conftest import engine_for, random_prompts, run_all, smollm_path
from twostep import SamplingParams
from twostep.attention.kv_layer_cache import dequantize, quantize
from twostep.config import kv_format

FORMATS = ["int8", "fp8_e4m3", "fp8_e5m2"]
# Worst error of one value relative to the absmax of its token's head vector: int8 rounds to
# 1/254 of the range; fp8 keeps 3 (e4m3) or 2 (e5m2) mantissa bits; the bf16 scale adds 2^-8.
REL_ERROR = {"int8": 1 / 254 + 2**-8, "fp8_e4m3": 2**-4 + 2**-8, "fp8_e5m2": 2**-3 + 2**-8}


def adversarial():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, 32, generator=g)
    x[0, 0, 0] = 1e4                       # one outlier in a head vector
    x[1] = 0                               # all zeros
    x[2] *= 1e-30                          # tiny values
    x[3] *= 1e30                           # huge values
    x[4, :, ::2] = 0                       # half zeros
    return x


@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_error_is_bounded_and_finite(fmt):
    f = kv_format(fmt)
    for x in (torch.randn(100, 3, 64) * 5, adversarial()):
        q, scale = quantize(x, f)
        y = dequantize(q, scale, torch.float32)
        assert torch.isfinite(y).all() and torch.isfinite(scale.float()).all()
        absmax = x.abs().amax(-1, keepdim=True)
        err = (y - x).abs()
        assert (err <= REL_ERROR[fmt] * absmax + 1e-30).all()
        assert torch.equal(y[x.abs().amax(-1) == 0], torch.zeros_like(y[x.abs().amax(-1) == 0]))


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3"])
def test_capacity_nearly_doubles(tmp_path, fmt):
    from conftest import make_tiny_model
    from twostep.config import EngineConfig
    from twostep.engine.llm_engine import LLMEngine

    # head_dim 64, as in SmolLM2 and most models: 64 bytes + a 2-byte scale per head vector
    # against 128 bytes in bf16, 2 x 64 / 66 = 1.94x (1.97x at head_dim 128).
    folder = make_tiny_model(tmp_path / "hd64", "llama", head_dim=64)

    def blocks(dtype, kv_dtype):
        return LLMEngine(EngineConfig(model=str(folder), dtype=dtype, kv_cache_memory="4MiB",
                                      kv_cache_dtype=kv_dtype)).kv_plan.num_blocks

    assert blocks("bfloat16", fmt) >= 1.9 * blocks("bfloat16", "auto")
    assert blocks("float32", fmt) >= 3.5 * blocks("float32", "auto")


def _next_token_logits(engine, prompt):
    engine.add_request(prompt, SamplingParams(max_tokens=1))
    logits = engine.runner.all_logits(engine.scheduler.schedule().plan)[-1]
    engine.abort_request(list(engine.scheduler.requests), emit_output=False)
    return logits


def _agreement(ref_generate, quant_generate, quant_prompt_logprobs, prompts, n=64):
    """(positional agreement of greedy continuations, teacher-forced top-1 agreement: the
    quantised model's argmax on the reference continuation, which has no cascade after a tie)."""
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    a, b = ref_generate(prompts, params), quant_generate(prompts, params)
    positional = sum(x == y for p, q in zip(a, b) for x, y in zip(p, q)) / sum(map(len, a))
    hits = total = 0
    for prompt, gen in zip(prompts, a):
        entries = quant_prompt_logprobs(prompt + gen)
        for i in range(len(prompt), len(prompt) + len(gen)):
            total += 1
            hits += entries[i][(prompt + gen)[i]].rank == 1
    return positional, hits / total


def _engine_fns(engine):
    def generate(prompts, params):
        return [o.outputs[0].token_ids for o in run_all(engine, prompts, params)]

    def prompt_logprobs(ids):
        params = SamplingParams(max_tokens=1, prompt_logprobs=1)
        return run_all(engine, [ids], params)[0].prompt_logprobs

    return generate, prompt_logprobs


# Stated bounds, tiny random qwen3 in float32 (logits span about +-10). Measured: max |logit diff|
# int8 ~0.02, fp8_e4m3 ~0.2; teacher-forced top-1 agreement over 4 x 64 tokens int8 >= 0.98.
LOGIT_BOUND = {"int8": 0.1, "fp8_e4m3": 0.6}
TINY_AGREEMENT = {"int8": 0.97, "fp8_e4m3": 0.85}


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3"])
def test_logits_and_greedy_agree_with_unquantised(tiny_model_dir, fmt):
    folder = tiny_model_dir("qwen3")
    ref = engine_for(folder, enable_prefix_caching=False)
    quant = engine_for(folder, enable_prefix_caching=False, kv_cache_dtype=fmt)
    for n in (16, 64, 200):
        prompt = random_prompts([n], seed=n)[0]
        diff = (_next_token_logits(ref, prompt) - _next_token_logits(quant, prompt)).abs().max().item()
        assert diff < LOGIT_BOUND[fmt], (n, diff)
    ref_gen, _ = _engine_fns(ref)
    quant_gen, quant_lp = _engine_fns(quant)
    _, teacher_forced = _agreement(ref_gen, quant_gen, quant_lp, random_prompts([5, 20, 40, 60], seed=31))
    assert teacher_forced >= TINY_AGREEMENT[fmt], teacher_forced


def test_quantised_outputs_do_not_depend_on_scheduling(tiny_model_dir):
    """Chunked prefill, block size, prefix-cache hits and preemption on int8 blocks give the same
    tokens as an int8 run without any of them (every query reads K/V back from the cache)."""
    folder = tiny_model_dir("llama")
    prompts = random_prompts()
    prompts += [prompts[5], prompts[7]]          # repeats: prefix-cache hits
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    base = engine_for(folder, kv_cache_dtype="int8", enable_prefix_caching=False)
    expected = [o.outputs[0].token_ids for o in run_all(base, prompts, params)]
    for kw in (dict(max_num_batched_tokens=7), dict(block_size=1, max_num_batched_tokens=64),
               dict(num_kv_blocks=10, max_num_batched_tokens=48), dict(max_num_batched_tokens=32)):
        engine = engine_for(folder, kv_cache_dtype="int8", **kw)
        outs = run_all(engine, prompts, params)
        assert [o.outputs[0].token_ids for o in outs] == expected, kw
    assert engine.get_stats()["prefix_cache_hits"] > 0


# The default model in float32, 8 chat prompts, 64 greedy tokens, against the unquantised cache,
# int16 activations (--cpu-int8-activations off: the cache's rounding alone, not the decode rows'
# int8 rounding too, which moved int8's teacher-forced agreement to 0.975).
# Measured (benchmarks: see README): int8 teacher-forced top-1 agreement 0.989, positional
# agreement 0.74 (3/8 continuations identical: after a near-tie the texts part ways);
# fp8_e4m3 0.960 / 0.39; fp8_e5m2 0.937 / 0.29. Positional agreement moves with any last-bit
# change upstream (an 8-bit code that sat on a rounding boundary flips): with the fused decode ops
# (float32 within a few ulps, identical continuations with a float cache) int8 measured 0.56.
SMOLLM_TEACHER_FORCED = {"int8": 0.98, "fp8_e4m3": 0.94, "fp8_e5m2": 0.91}
SMOLLM_POSITIONAL = {"int8": 0.5}
# Next-token logits after each prompt (they span about +-38): measured worst |diff| int8 0.91,
# fp8_e4m3 1.65, fp8_e5m2 3.91.
SMOLLM_LOGIT_BOUND = {"int8": 1.5, "fp8_e4m3": 2.5, "fp8_e5m2": 5.0}
QUESTIONS = ["What is the capital of France?", "Name three primary colours.", "Write a haiku about the sea.",
             "What is 12 times 7?", "Explain photosynthesis in one sentence.", "Who wrote Romeo and Juliet?",
             "Give me a synonym for happy.", "What is the boiling point of water in Celsius?"]


@pytest.mark.slow
def test_smollm2_with_8bit_kv():
    from twostep import LLM

    path = str(smollm_path())
    ref = LLM(path, dtype="float32", kv_cache_memory="64MiB", enable_prefix_caching=False, cpu_int8_activations="off")
    prompts = [ref.tokenizer.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    ref_gen, _ = _engine_fns(ref.engine)
    for fmt, bound in SMOLLM_TEACHER_FORCED.items():
        llm = LLM(path, dtype="float32", kv_cache_memory="64MiB", kv_cache_dtype=fmt,
                  enable_prefix_caching=False, cpu_int8_activations="off")
        gen, lp = _engine_fns(llm.engine)
        positional, teacher_forced = _agreement(ref_gen, gen, lp, prompts)
        assert teacher_forced >= bound, (fmt, teacher_forced)
        assert positional >= SMOLLM_POSITIONAL.get(fmt, 0.0), (fmt, positional)
        worst = max((_next_token_logits(ref.engine, p) - _next_token_logits(llm.engine, p)).abs().max().item()
                    for p in prompts)
        assert worst < SMOLLM_LOGIT_BOUND[fmt], (fmt, worst)
        if fmt == "int8":
            out = llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
            assert "Paris" in out[0].outputs[0].text
