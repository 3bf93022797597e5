"""Greedy output must not depend on chunk size, block size, batch or preemption."""
from __future__ import annotations

import pytest

from conftest import GREEDY, engine_for, load_hf, nan_filled_kv_cache, random_prompts, run_all
from twostep import SamplingParams


@pytest.mark.parametrize("budget", [1, 7, 64])
def test_chunked_prefill_budgets(reference, budget):
    folder, prompts, expected = reference
    engine = engine_for(folder, max_num_batched_tokens=budget)
    outs = run_all(engine, prompts)
    assert [o.outputs[0].token_ids for o in outs] == expected


@pytest.mark.parametrize("block_size", [1, 16])
def test_block_sizes(reference, block_size):
    folder, prompts, expected = reference
    engine = engine_for(folder, block_size=block_size, max_num_batched_tokens=40)
    outs = run_all(engine, prompts)
    assert [o.outputs[0].token_ids for o in outs] == expected


@pytest.mark.parametrize("block_size,num_blocks", [(16, 10), (1, 120)])
def test_preemption_by_recompute_keeps_outputs(reference, block_size, num_blocks):
    folder, prompts, expected = reference
    engine = engine_for(folder, block_size=block_size, num_kv_blocks=num_blocks,
                        max_num_batched_tokens=48)
    outs = run_all(engine, prompts)
    assert engine.scheduler.num_preemptions > 0, "the cache was meant to be too small"
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert sum(o.metrics.num_preemptions for o in outs) == engine.scheduler.num_preemptions


def test_steps_mix_decodes_and_prefill_chunks(reference):
    folder, prompts, _ = reference
    engine = engine_for(folder, max_num_batched_tokens=16)
    engine.add_request(prompts[0], GREEDY)
    engine.add_request(prompts[1], GREEDY)
    engine.step()
    engine.step()  # both decoding now
    engine.add_request(prompts[-1], GREEDY)  # 64-token prompt: four chunks of <= 14
    sched = engine.scheduler.schedule()
    kinds = sorted(s.num_tokens for s in sched.scheduled)
    assert kinds == [1, 1, 14], "two decodes go first, the prefill chunk fills the rest"
    assert sched.num_tokens == 16


def test_decodes_continue_while_long_prompt_prefills(reference):
    folder, prompts, _ = reference
    engine = engine_for(folder, max_num_batched_tokens=8)
    first = engine.add_request(prompts[2], GREEDY)
    while not engine.scheduler.requests[first].output_token_ids:
        engine.step()
    engine.add_request(prompts[-1], GREEDY)
    for _ in range(4):  # the 64-token prompt needs many steps; the decode never stalls
        before = len(engine.scheduler.requests[first].output_token_ids)
        engine.step()
        assert len(engine.scheduler.requests[first].output_token_ids) == before + 1


def test_abort_frees_blocks_at_any_time(reference):
    folder, prompts, expected = reference
    engine = engine_for(folder, max_num_batched_tokens=16)
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    aborted = {ids[0], ids[5], ids[7]}
    done = {}

    def step():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        engine.scheduler.kv.check_integrity()

    engine.abort_request(ids[7])   # still waiting
    step()
    engine.abort_request(ids[5])   # mid-prefill or waiting
    for _ in range(3):
        step()
    assert engine.scheduler.requests[ids[0]].output_token_ids, "decoding by now"
    engine.abort_request(ids[0])   # decoding
    step()
    while engine.has_unfinished_requests():
        step()
    for rid, exp in zip(ids, expected):
        if rid in aborted:
            assert done[rid].outputs[0].finish_reason == "abort"
        else:
            assert done[rid].outputs[0].token_ids == exp
    assert engine.scheduler.kv.num_free_blocks == engine.scheduler.kv.num_blocks


def test_request_that_outgrows_the_whole_cache_ends_with_length(reference):
    folder, prompts, expected = reference
    engine = engine_for(folder, block_size=16, num_kv_blocks=3)   # 48 tokens in all
    outs = run_all(engine, [prompts[3]], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    out = outs[0].outputs[0]
    assert out.finish_reason == "length"
    # 48 tokens fill the cache; the token sampled from the last of them needs no slot yet
    assert len(prompts[3]) + len(out.token_ids) == 49
    assert out.token_ids[:32] == expected[3]
    # the step that ended it counted its preemption at once (/metrics' num_preemptions_total)
    assert engine.get_stats()["num_preemptions"] == outs[0].metrics.num_preemptions == 1


def test_max_num_seqs_caps_running(reference):
    folder, prompts, expected = reference
    engine = engine_for(folder, max_num_seqs=2)
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    peak = 0
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        peak = max(peak, len(engine.scheduler.running))
    assert peak == 2
    assert [done[i].outputs[0].token_ids for i in ids] == expected


def test_garbage_in_unwritten_cache_slots_never_leaks(reference, monkeypatch):
    """The cache is allocated uninitialised: simulate the worst garbage (NaN everywhere);
    padding reads must not let it through."""
    import twostep.core.execution.model_builder as builder_module

    monkeypatch.setattr(builder_module, "allocate_kv_cache", nan_filled_kv_cache)
    folder, prompts, expected = reference
    engine = engine_for(folder, max_num_batched_tokens=64)
    outs = run_all(engine, prompts)
    assert [o.outputs[0].token_ids for o in outs] == expected


@pytest.mark.parametrize("arch", ["mistral", "qwen2", "qwen3", "llama-bias"])
def test_every_architecture_is_invariant_to_chunks_blocks_and_preemption(tiny_model_dir, arch):
    from conftest import hf_greedy

    folder = tiny_model_dir(arch)
    hf = load_hf(folder)
    prompts = random_prompts()
    expected = [hf_greedy(hf, p, 32) for p in prompts]
    for kw in (dict(max_num_batched_tokens=7), dict(block_size=1, max_num_batched_tokens=64),
               dict(num_kv_blocks=10, max_num_batched_tokens=48)):
        engine = engine_for(folder, **kw)
        assert [o.outputs[0].token_ids for o in run_all(engine, prompts)] == expected, kw
