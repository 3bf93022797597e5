"""Every family added as a file (models/families/) against transformers under the scheduling that
stresses per-layer attention: prompts several sliding windows long, prompt chunks shorter than the
window, blocks of 4 tokens, a cache too small for the batch (preemption), and a second batch whose
prompts extend the first's (prefix-cache hits); float32 greedy tokens identical, prompt logprobs
within 1e-4."""
from __future__ import annotations

import pytest
import torch

from conftest import engine_for, hf_greedy, load_hf, random_prompts, run_all
from twostep import SamplingParams

FAMILIES = ["mistral-window", "gemma2", "gemma3", "phi3", "phi3-longrope", "smollm3", "olmo2", "granite", "glm4",
            "qwen3-moe", "mixtral", "gpt-oss", "olmoe", "qwen2-moe", "qwen3.5", "qwen3.5-moe", "qwen3-next"]
WINDOW = 8          # the tiny windowed models' (conftest.ARCH_CONFIGS)


@pytest.mark.parametrize("arch", FAMILIES)
def test_greedy_tokens_under_chunks_preemption_and_prefix_hits(tiny_model_dir, arch):
    folder = tiny_model_dir(arch)
    hf = load_hf(folder)
    first = random_prompts([30, 3, 44, 17, 64, 9], seed=5)
    second = [first[0] + [7, 8, 9], first[4][:40] + [11, 12]]       # their blocks are cached by then
    # a model windowed in every layer releases blocks as it goes: a smaller cache still preempts
    blocks = 12 if arch == "mistral-window" else 40
    engine = engine_for(folder, block_size=4, max_num_batched_tokens=WINDOW - 2, num_kv_blocks=blocks)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for prompts in (first, second):
        outs = run_all(engine, prompts, params)
        for p, o in zip(prompts, outs):
            assert o.outputs[0].token_ids == hf_greedy(hf, p, 24), f"{arch}: prompt of {len(p)} tokens"
    assert engine.scheduler.num_preemptions > 0, "the cache was meant to be too small for the batch"
    assert engine.scheduler.kv.prefix_stats.hits > 0, "the second batch was meant to hit the first's blocks"


@pytest.mark.parametrize("arch", FAMILIES)
def test_prompt_logprobs_match_transformers(tiny_model_dir, arch):
    folder = tiny_model_dir(arch)
    hf = load_hf(folder)
    engine = engine_for(folder, block_size=4, max_num_batched_tokens=WINDOW - 2)
    prompt = random_prompts([45], seed=9)[0]
    out = run_all(engine, [prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))[0]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)
    for i in range(1, len(prompt)):
        assert abs(out.prompt_logprobs[i][prompt[i]].logprob - ref[i - 1, prompt[i]].item()) < 1e-4, (arch, i)


def test_longrope_past_the_original_context_takes_the_long_factors(tmp_path):
    """A context longer than the original one: the long factors, as transformers picks them for a
    sequence that long (its choice is per sequence length; twostep's per max_model_len, as llama.cpp)."""
    from conftest import make_tiny_model

    folder = make_tiny_model(tmp_path / "m", "phi3-longrope", max_position_embeddings=512)
    hf = load_hf(folder)
    prompt = random_prompts([150], seed=3)[0]            # past the original 128 positions
    engine = engine_for(folder, max_num_batched_tokens=64)
    out = run_all(engine, [prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))[0]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)
    worst = max(abs(out.prompt_logprobs[i][prompt[i]].logprob - ref[i - 1, prompt[i]].item())
                for i in range(1, len(prompt)))
    assert worst < 1e-4


def test_a_checkpoint_with_tensors_the_family_lacks_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    from conftest import make_tiny_model

    folder = make_tiny_model(tmp_path / "m", "olmo2")
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.0.self_attn.sinks"] = torch.zeros(4)
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ValueError, match="model.layers.0.self_attn.sinks"):
        engine_for(folder)


@pytest.mark.parametrize("arch", ["mistral-window", "phi3", "gemma2", "gemma3"])
def test_a_sliding_window_bounds_each_sequences_blocks(tmp_path, arch):
    """In each sliding-window group (every layer of Mistral's and Phi-3's, the windowed layers of
    Gemma's), a sequence holds at most the window's blocks plus the one being filled after each
    step, however long it generates; a full-attention group keeps every block; tokens still
    transformers'."""
    from conftest import make_tiny_model

    folder = make_tiny_model(tmp_path / arch, arch, sliding_window=WINDOW)
    hf = load_hf(folder)
    engine = engine_for(folder, block_size=4, max_num_batched_tokens=WINDOW - 2)
    kv = engine.scheduler.kv
    windows = [g.window for g in kv.groups]
    assert windows == ([WINDOW] if arch in ("mistral-window", "phi3") else [None, WINDOW])
    prompts = random_prompts([37, 5], seed=4)
    ids = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=90, ignore_eos=True)) for p in prompts]
    done, most = {}, [0] * len(kv.groups)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        kv.check_integrity()
        most = [max([m] + [g.num_blocks_of(r) for r in ids]) for m, g in zip(most, kv.groups)]
    for g, m in zip(kv.groups, most):
        if g.window is not None:
            assert m <= -(-WINDOW // 4) + 1, f"{m} blocks held for a window of {WINDOW} tokens in blocks of 4"
        else:
            assert m == -(-(37 + 90 - 1) // 4), "a full-attention layer needs every block"
    for p, i in zip(prompts, ids):
        assert done[i].outputs[0].token_ids == hf_greedy(hf, p, 90)
    assert kv.num_free_blocks == kv.num_blocks


def test_sliding_layers_get_a_windows_blocks_per_sequence(tiny_model_dir):
    """Sized from memory, Gemma's sliding-window layers get what max_num_seqs sequences hold at once
    (a window each, plus a step's new tokens between them), the full-attention layers the rest of
    the budget."""
    engine = engine_for(tiny_model_dir("gemma3"), block_size=4, max_num_seqs=3, max_num_batched_tokens=WINDOW,
                        kv_cache_memory="1MiB")
    full, sliding = engine.kv_plan.groups
    assert (full.window, sliding.window) == (None, WINDOW)
    assert sliding.num_blocks == 3 * (WINDOW // 4 + 2) + WINDOW // 4
    per_block = 4 * (full.bytes_per_token + sliding.bytes_per_token)
    assert full.num_blocks > (1 << 20) // per_block, "the full layers got the sliding layers' share too"
    assert engine.kv_plan.total_bytes <= (1 << 20) + 8 * per_block
    assert [g.pool.num_blocks for g in engine.scheduler.kv.groups] == [full.num_blocks, sliding.num_blocks]
