"""Hybrid models (Gated DeltaNet linear attention beside attention: Qwen3.5 dense and MoE,
Qwen3-Next) against transformers where their state is stressed: prompt chunks of 1, 3 and 7
tokens (the state carried across steps), a batch mixing lengths, preemption (the state recomputed),
the prefix cache (a saved state restored with the attention layers' blocks; outputs identical with
and without it), speculative decoding (rejected drafts leave nothing in the state); every state
slot and block free after each run."""
from __future__ import annotations

import pytest
import torch

from conftest import assert_all_free, engine_for, hf_greedy, load_hf, make_tiny_model, random_prompts, run_all
from twostep import SamplingParams

HYBRIDS = ["qwen3.5", "qwen3.5-moe", "qwen3-next"]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def hf_models(tiny_model_dir):
    cache = {}

    def get(arch):
        if arch not in cache:
            cache[arch] = load_hf(tiny_model_dir(arch))
        return cache[arch]
    return get


@pytest.mark.parametrize("arch", HYBRIDS)
@pytest.mark.parametrize("chunk", [1, 3, 7])
def test_chunked_prefill_carries_the_state(tiny_model_dir, hf_models, arch, chunk):
    folder, hf = tiny_model_dir(arch), hf_models(arch)
    prompts = random_prompts([1, 9, 23], seed=chunk)
    engine = engine_for(folder, block_size=4, max_num_batched_tokens=chunk)
    for p, o in zip(prompts, run_all(engine, prompts, GREEDY)):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, 12), (arch, chunk, len(p))


@pytest.mark.parametrize("arch", HYBRIDS)
def test_prompt_logprobs_under_small_chunks(tiny_model_dir, hf_models, arch):
    folder, hf = tiny_model_dir(arch), hf_models(arch)
    prompt = random_prompts([30], seed=4)[0]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)
    for chunk in (1, 3, 7):
        engine = engine_for(folder, block_size=4, max_num_batched_tokens=chunk)
        out = run_all(engine, [prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))[0]
        for i in range(1, len(prompt)):
            assert abs(out.prompt_logprobs[i][prompt[i]].logprob - ref[i - 1, prompt[i]].item()) < 1e-4, (chunk, i)


def test_a_mixed_batch_under_preemption(tiny_model_dir, hf_models):
    folder, hf = tiny_model_dir("qwen3.5"), hf_models("qwen3.5")
    prompts = random_prompts([40, 2, 17, 33, 5, 26], seed=7)
    engine = engine_for(folder, block_size=4, max_num_batched_tokens=16, num_kv_blocks=24)
    outs = run_all(engine, prompts, GREEDY)
    assert engine.scheduler.num_preemptions > 0, "the cache was meant to be too small for the batch"
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, 12)


def test_state_slots_bound_the_running_sequences(tiny_model_dir, hf_models):
    """A budget with room for two states: two sequences run at once of the four allowed, the
    others wait for a slot, and everything finishes right."""
    folder, hf = tiny_model_dir("qwen3.5"), hf_models("qwen3.5")
    prompts = random_prompts([11, 6, 19, 8], seed=8)
    engine = engine_for(folder, block_size=4, kv_cache_memory="64KiB", max_num_seqs=4)
    assert engine.scheduler.kv.states.pool.num_blocks == 2
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    most, done = 0, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = out
        most = max(most, engine.num_running)
        engine.scheduler.kv.check_integrity()
    assert most == 2
    assert_all_free(engine)
    for p, i in zip(prompts, ids):
        assert done[i].outputs[0].token_ids == hf_greedy(hf, p, 12)


@pytest.mark.parametrize("arch", ["qwen3.5", "qwen3-next"])
def test_prefix_hits_restore_the_saved_state(tiny_model_dir, arch):
    """A repeated prompt and a chat's next turn hit the state saved at the first prompt's last block
    boundary; outputs equal a cache-less engine's, and the hit is real (tokens skipped)."""
    folder = tiny_model_dir(arch)
    first = random_prompts([29], seed=11)[0]
    cold = engine_for(folder, block_size=4, enable_prefix_caching=False)
    warm = engine_for(folder, block_size=4)
    [turn1] = run_all(warm, [first], GREEDY)
    following = [first, first + turn1.outputs[0].token_ids + [5, 6, 7], first[:20] + [9, 9]]
    outs = run_all(warm, following, GREEDY)
    assert warm.scheduler.kv.prefix_stats.hits >= 2 * 28, "the repeat and the next turn were meant to hit"
    assert outs[0].num_cached_tokens == 28 and outs[1].num_cached_tokens == 28
    assert outs[2].num_cached_tokens == 0, "no state was saved inside the first prompt's blocks"
    for o, ref in zip(outs, run_all(cold, following, GREEDY)):
        assert o.outputs[0].token_ids == ref.outputs[0].token_ids
    warm.scheduler.kv.check_integrity()


def test_a_shared_system_prompt_hits_from_its_third_use(tiny_model_dir):
    """The second prompt with the same system prompt finds its blocks cached but no state there: it
    saves its state where it parts from the first, and the third one hits there."""
    folder = tiny_model_dir("qwen3.5")
    system = random_prompts([21], seed=17)[0]
    questions = random_prompts([5, 6, 7], seed=18)
    prompts = [system + q for q in questions]
    warm = engine_for(folder, block_size=4)
    outs = [run_all(warm, [p], GREEDY)[0] for p in prompts]
    assert [o.num_cached_tokens for o in outs] == [0, 0, 20]
    for o, ref in zip(outs, run_all(engine_for(folder, block_size=4, enable_prefix_caching=False), prompts, GREEDY)):
        assert o.outputs[0].token_ids == ref.outputs[0].token_ids


def test_saved_states_are_evicted_like_blocks(tiny_model_dir):
    """More prompts than saved-state slots: older states are evicted, the cache keeps working."""
    folder = tiny_model_dir("qwen3.5")
    engine = engine_for(folder, block_size=4, max_num_seqs=2)     # 4 slots: 2 live, 2 saved
    prompts = random_prompts([13, 14, 15, 16, 17], seed=12)
    for p in prompts:
        run_all(engine, [p], GREEDY)
    pool = engine.scheduler.kv.states.pool
    assert pool.num_evictions > 0 and pool.num_cached_blocks <= pool.num_blocks
    assert_all_free(engine)


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    """Tiny hybrids and a llama over 8 tokens: drafts are often right and often wrong."""
    root = tmp_path_factory.mktemp("vocab8")
    return lambda arch: make_tiny_model(root / arch, arch, vocab_size=8) if not (root / arch).exists() else root / arch


def _spec_counts(engine) -> tuple[int, int]:
    stats = engine.get_stats()
    return stats["spec_decode_num_draft_tokens"], stats["spec_decode_num_accepted_tokens"]


@pytest.mark.parametrize("arch", ["qwen3.5", "qwen3.5-moe"])
def test_ngram_speculation_is_lossless(small_vocab, arch):
    folder = small_vocab(arch)
    prompts = [[3, 5, 1, 6] * 4, [7, 2, 2, 4, 0, 1], [6]]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    plain = run_all(engine_for(folder, block_size=4), prompts, params)
    spec = engine_for(folder, block_size=4, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                                "prompt_lookup_min": 1})
    outs = run_all(spec, prompts, params)
    drafted, accepted = _spec_counts(spec)
    assert 0 < accepted < drafted, "drafts were meant to be partly accepted, partly rejected"
    for a, b in zip(plain, outs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_a_draft_model_for_a_hybrid_target_is_lossless(small_vocab):
    folder, draft = small_vocab("qwen3.5"), small_vocab("llama")
    prompts = [[1, 2, 3], [4, 0, 6, 6, 2, 5, 7, 1, 3]]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = run_all(engine_for(folder, block_size=4), prompts, params)
    spec = engine_for(folder, block_size=4, speculative_config={"method": "draft_model", "model": str(draft),
                                                                "num_speculative_tokens": 3})
    for a, b in zip(plain, run_all(spec, prompts, params)):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    drafted, accepted = _spec_counts(spec)
    assert 0 < accepted < drafted


def test_a_hybrid_draft_model_is_refused(small_vocab):
    with pytest.raises(ValueError, match="linear-attention"):
        engine_for(small_vocab("llama"), speculative_config={"method": "draft_model",
                                                              "model": str(small_vocab("qwen3.5"))})


def test_what_does_not_take_a_state_is_refused_clearly(tiny_model_dir):
    folder = tiny_model_dir("qwen3.5")
    with pytest.raises(ValueError, match="linear-attention"):
        engine_for(folder, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="linear-attention layers keep a state"):
        engine_for(folder, kv_transfer_config={"kv_role": "kv_producer", "kv_port": 0})


def test_an_image_is_refused_by_name(tiny_model_dir):
    """Qwen3.5 checkpoints are multimodal; twostep loads their text model and says so of an image."""
    from twostep import LLM

    llm = LLM(str(tiny_model_dir("qwen3.5")), dtype="float32", kv_cache_memory="8MiB")
    message = {"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                           {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}
    with pytest.raises(ValueError, match="'image_url'.*vision tower is not loaded"):
        llm.chat([message], SamplingParams(max_tokens=2))


def test_aborts_free_states_and_the_others_go_on(tiny_model_dir, hf_models):
    """Requests aborted mid-prompt and mid-decode give their slots back; the others' outputs stay right."""
    folder, hf = tiny_model_dir("qwen3.5"), hf_models("qwen3.5")
    prompts = random_prompts([30, 8, 19], seed=16)
    engine = engine_for(folder, block_size=4, max_num_batched_tokens=8)
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    done = {}
    for step in range(40):
        if step == 2:
            engine.abort_request(ids[0])          # still in its prompt
        if step == 6:
            engine.abort_request(ids[2])          # decoding by now
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        engine.scheduler.kv.check_integrity()
        if not engine.has_unfinished_requests():
            break
    assert_all_free(engine)
    assert done[ids[1]].outputs[0].token_ids == hf_greedy(hf, prompts[1], 12)
    assert done[ids[0]].outputs[0].finish_reason == "abort"
