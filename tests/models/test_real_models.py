"""Real small models: the packaged SmolLM2-135M-Instruct GGUF and ../shared's stories260K."""
from __future__ import annotations

import pytest
import torch

from conftest import smollm_path, stories_path
from twostep import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=64)
STORIES_PROMPT = [1, 403, 407, 261, 378]  # "<s> Once upon a time"
STORIES_EXPECTED = (", there was a little girl named Lily. She loved to play outside in the park. One day, "
                    "she saw a big, red ball. She wanted to play with it, but it was too high.\nLily")
# Tolerance for SmolLM2's logits against transformers on the same dequantised weights, in float32
# (logits span about +-38). Measured: 0.0 max abs difference while a prompt's linears were MKL's
# GEMM on dequantized tiles, as transformers' are (AVX-512 builds still); 1.4e-4 on an AVX2 Zen 1,
# where they are oneDNN's float brgemm on the panel layout (gemm_f32): float32 sums in another
# order, 30 layers deep.
SMOLLM_LOGIT_ATOL = 3e-4


def hf_from_gguf(path, **kw):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32, **kw)
    return model.eval()


@pytest.fixture(scope="module")
def smollm():
    return LLM(str(smollm_path()), dtype="float32", kv_cache_memory="256MiB")


def test_smollm2_says_paris(smollm):
    out = smollm.chat([{"role": "user", "content": "What is the capital of France?"}], GREEDY,
                      use_tqdm=False)[0].outputs[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"


def test_smollm2_default_model_is_found():
    from twostep.models.loader import resolve_model_path

    assert resolve_model_path(None) == str(smollm_path())


@pytest.mark.slow
def test_smollm2_logits_match_transformers(smollm):
    path = smollm_path()
    hf = hf_from_gguf(path)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = smollm.tokenizer.encode_chat(messages)
    engine = smollm.engine
    engine.reset_prefix_cache()   # compute every position, not only what an earlier test left
    engine.add_request(ids, SamplingParams(max_tokens=1))
    sched = engine.scheduler.schedule()
    ours = engine.runner.all_logits(sched.plan)
    engine.abort_request(list(engine.scheduler.requests))
    engine.step()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    assert (ours - ref).abs().max().item() < SMOLLM_LOGIT_ATOL
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    ref_tokens = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, len(ids):]
    # decode at full precision (by default a quantized model's decode rows round to int8)
    exact = LLM(str(path), dtype="float32", kv_cache_memory="64MiB", cpu_int8_activations="off")
    out = exact.generate([ids], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == ref_tokens.tolist()[:len(out.outputs[0].token_ids)]


def test_stories260k_tells_the_story():
    llm = LLM(str(stories_path()), dtype="float32", kv_cache_memory="16MiB")
    assert llm.tokenizer.encode("Once upon a time") == STORIES_PROMPT
    out = llm.generate([STORIES_PROMPT], SamplingParams(temperature=0, max_tokens=40),
                       use_tqdm=False)[0].outputs[0]
    assert out.text.startswith(STORIES_EXPECTED[:60])


def test_stories260k_matches_transformers_on_the_same_file():
    path = stories_path()
    hf = hf_from_gguf(path, pad_token_id=None)
    llm = LLM(str(path), dtype="float32", kv_cache_memory="16MiB")
    ref = hf.generate(torch.tensor([STORIES_PROMPT]), max_new_tokens=48, do_sample=False)[0, 5:].tolist()
    out = llm.generate([STORIES_PROMPT], SamplingParams(temperature=0, max_tokens=48),
                       use_tqdm=False)[0].outputs[0]
    n = len(out.token_ids)
    assert out.token_ids == ref[:n]
    assert n == len(ref) or out.finish_reason == "stop"
    assert out.text == llm.tokenizer.decode(ref[:n])


# bfloat16 (what dtype="auto" picks on a CPU with native bf16) against float32 on the default model:
# measured max |logit diff| 1.56, mean 0.19, top-1 agreement 95% over a 43-token chat prompt (1.34,
# 0.16, 95% since the prompt's rows take gemm_bf16, 2026-12-04).
BF16_MEAN_LOGIT_DIFF = 0.3
BF16_TOP1_AGREEMENT = 0.9


def test_bfloat16_stays_within_the_stated_tolerance_of_float32():
    path = str(smollm_path())
    messages = [{"role": "user", "content":
                 "What is the capital of France? Explain photosynthesis in one sentence."}]
    logits = {}
    for dtype in ("float32", "bfloat16"):
        llm = LLM(path, dtype=dtype, kv_cache_memory="64MiB", enable_prefix_caching=False)
        engine = llm.engine
        engine.add_request(llm.tokenizer.encode_chat(messages), SamplingParams(max_tokens=1))
        logits[dtype] = engine.runner.all_logits(engine.scheduler.schedule().plan)
    diff = (logits["float32"] - logits["bfloat16"]).abs()
    agree = (logits["float32"].argmax(-1) == logits["bfloat16"].argmax(-1)).float().mean().item()
    assert diff.mean().item() < BF16_MEAN_LOGIT_DIFF
    assert agree >= BF16_TOP1_AGREEMENT


def test_smollm2_says_paris_in_bfloat16():
    llm = LLM(str(smollm_path()), dtype="bfloat16", kv_cache_memory="64MiB")
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}], GREEDY,
                   use_tqdm=False)[0].outputs[0]
    assert "Paris" in out.text
