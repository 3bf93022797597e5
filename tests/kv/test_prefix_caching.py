"""Automatic prefix caching: identical outputs, exact accounting, eviction, random interleavings."""
from __future__ import annotations

import random

import pytest
import torch

from conftest import engine_for, run_all
from twostep import SamplingParams
from twostep.kv.block_hash import BlockKey, block_key, chain_keys
from twostep.kv.block_pool import BlockPool, FreeBlockQueue, KVBlock
from twostep.kv.kv_cache_manager import KVCacheManager

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def tokens(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 384, (n,), generator=g).tolist()


def run(engine, prompts, params=GREEDY):
    """All prompts to completion, block accounting checked after every step."""
    return run_all(engine, prompts, params)


@pytest.fixture(scope="module")
def folder(tiny_model_dir):
    return tiny_model_dir("qwen3")


def shared_prefix_prompts():
    system = tokens(70, 1)
    return [
        system[:5] + tokens(9, 2),          # shares less than a block
        system[:16] + tokens(7, 3),         # exactly one block
        system[:64] + tokens(11, 4),        # many blocks
        system + tokens(3, 5),
        system + tokens(20, 6),
        list(system),                       # the whole prompt again
        list(system),
        system[:16],                        # exactly one block and nothing else
    ]


@pytest.mark.parametrize("budget", [7, 64, 2048])
def test_outputs_identical_with_and_without_caching(folder, budget):
    prompts = shared_prefix_prompts()
    off = engine_for(folder, enable_prefix_caching=False, max_num_batched_tokens=budget)
    on = engine_for(folder, max_num_batched_tokens=budget)
    expected = [o.outputs[0].token_ids for o in run(off, prompts)]
    # concurrently (hits only where a block was completed in an earlier step) ...
    assert [o.outputs[0].token_ids for o in run(on, prompts)] == expected
    # ... and again one after another, now that everything is cached
    for p, exp in zip(prompts, expected):
        out = run(on, [p])[0]
        assert out.outputs[0].token_ids == exp
        assert out.num_cached_tokens == (len(p) - 1) // 16 * 16
    assert on.scheduler.kv.num_free_blocks == on.scheduler.kv.num_blocks


def test_exact_hit_accounting(folder):
    engine = engine_for(folder)
    prompt = tokens(100, 7)
    first = run(engine, [prompt])[0]
    second = run(engine, [prompt])[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 96 and second.metrics.num_cached_tokens == 96
    stats = engine.get_stats()
    assert stats["prefix_cache_queries"] == 200 and stats["prefix_cache_hits"] == 96
    assert stats["prefix_cache_hit_rate"] == pytest.approx(0.48)
    # a 96-token prompt: whole blocks, but the last token must be computed -> 80 cached
    aligned = tokens(96, 8)
    run(engine, [aligned])
    assert run(engine, [aligned])[0].num_cached_tokens == 80


def test_prompt_logprobs_requests_compute_everything(folder):
    engine = engine_for(folder)
    prompt = tokens(40, 9)
    run(engine, [prompt])
    out = run(engine, [prompt], SamplingParams(max_tokens=2, prompt_logprobs=1))[0]
    assert out.num_cached_tokens == 0 and len(out.prompt_logprobs) == 40


def test_multi_turn_reuses_generated_blocks(folder):
    engine = engine_for(folder)
    turn1 = tokens(30, 10)
    out = run(engine, [turn1], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0]
    history = turn1 + out.outputs[0].token_ids          # 50 tokens, 3 full blocks
    follow_up = history + tokens(10, 11)
    second = run(engine, [follow_up])[0]
    assert second.num_cached_tokens == 48  # two prompt blocks and one holding generated tokens


def test_eviction_under_pressure_keeps_outputs(folder):
    prompts = [p for p in shared_prefix_prompts() for _ in range(2)]
    expected = [o.outputs[0].token_ids for o in
                run(engine_for(folder, enable_prefix_caching=False), prompts)]
    engine = engine_for(folder, num_kv_blocks=12, max_num_batched_tokens=32)
    for round_ in range(2):
        outs = run(engine, prompts)
        assert [o.outputs[0].token_ids for o in outs] == expected
    assert engine.scheduler.kv.pool.num_evictions > 0
    assert engine.scheduler.kv.num_free_blocks == engine.scheduler.kv.num_blocks


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_randomised_interleaving_of_add_abort_preempt_finish(folder, seed):
    rng = random.Random(seed)
    bases = [tokens(48, 20), tokens(33, 21)]
    def make_prompt():
        base = rng.choice(bases)
        return base[:rng.choice([0, 5, 16, 32, len(base)])] + tokens(rng.randint(1, 20), rng.randint(0, 10**6))
    prompts = [make_prompt() for _ in range(24)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(1, 16), ignore_eos=True) for _ in prompts]
    reference = engine_for(folder, enable_prefix_caching=False)
    expected = {}
    for i, (p, sp) in enumerate(zip(prompts, params)):
        expected[i] = run(reference, [p], sp)[0].outputs[0].token_ids

    engine = engine_for(folder, num_kv_blocks=8, max_num_batched_tokens=24, max_num_seqs=8)
    live: dict[str, int] = {}
    aborted: set[str] = set()
    results = {}
    pending = list(range(len(prompts)))
    while pending or engine.has_unfinished_requests():
        action = rng.random()
        if pending and action < 0.5:
            for _ in range(rng.randint(1, 3)):
                if pending:
                    i = pending.pop(0)
                    live[engine.add_request(prompts[i], params[i])] = i
        elif live and action < 0.56:
            rid = rng.choice(sorted(live))
            engine.abort_request(rid)
            aborted.add(rid)
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out
                live.pop(out.request_id, None)
        engine.scheduler.kv.check_integrity()
    assert engine.scheduler.num_preemptions > 0, "the cache was meant to force preemption"
    assert engine.scheduler.kv.pool.num_cached_blocks > 0
    checked = 0
    for rid, out in results.items():
        i = int(rid.split("-")[1]) - 1
        if rid in aborted and out.outputs[0].finish_reason == "abort":
            assert out.outputs[0].token_ids == expected[i][:len(out.outputs[0].token_ids)]
        else:
            assert out.outputs[0].token_ids == expected[i]
            checked += 1
    assert checked >= len(prompts) // 3
    assert engine.scheduler.kv.num_free_blocks == engine.scheduler.kv.num_blocks


def test_free_queue_removes_from_the_middle():
    blocks = [KVBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[2])
    q.remove(blocks[0])
    q.remove(blocks[4])
    assert [b.block_id for b in q] == [1, 3] and q.num_free == 2
    q.append(blocks[2])
    assert q.popleft() is blocks[1] and [b.block_id for b in q] == [3, 2]


def test_suffix_blocks_are_evicted_before_their_prefix_and_lru_first():
    kv = KVCacheManager(num_blocks=6, block_size=4)
    old = list(range(100, 112))   # 3 full blocks
    new = list(range(200, 212))
    for rid, toks in (("old", old), ("new", new)):
        assert kv.allocate_slots(rid, 0, len(toks))
        kv.cache_full_blocks(rid, toks, len(toks))
    old_ids, new_ids = kv.block_ids("old"), kv.block_ids("new")
    kv.free("old")
    kv.free("new")
    kv.check_integrity()
    order = [b.block_id for b in kv.pool.free_queue]
    assert order == old_ids[::-1] + new_ids[::-1]      # least recently freed first, tails first
    assert kv.allocate_slots("x", 0, 4)                 # one block: evicts old's last block
    (hits,), n = kv.get_computed_blocks("probe", old + [1])      # the only group's
    assert n == 8 and [b.block_id for b in hits] == old_ids[:2]
    kv.check_integrity()


def test_blocks_in_use_are_never_evicted():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    toks = list(range(10, 22))
    assert kv.allocate_slots("a", 0, 12)
    kv.cache_full_blocks("a", toks, 12)
    assert not kv.allocate_slots("b", 0, 8), "only one free block: must refuse, not evict"
    (hits,), n = kv.get_computed_blocks("c", toks + [5])
    assert n == 12
    assert kv.allocate_slots("c", n, 1, [hits])         # shares a's blocks, takes the last free one
    assert [b.ref_cnt for b in hits] == [2, 2, 2]
    kv.free("a")
    assert [b.ref_cnt for b in hits] == [1, 1, 1]
    kv.check_integrity()


def test_hits_are_confirmed_by_tokens_not_only_the_hash():
    pool = BlockPool(2)
    real = block_key(None, [1, 2, 3, 4])
    pool.cache(pool.allocate(1)[0], real)
    forged = BlockKey(real.value, None, (9, 9, 9, 9))   # same hash value, other tokens
    assert pool.lookup(real) is not None
    assert pool.lookup(forged) is None
    other_parent = BlockKey(real.value, 12345, real.token_ids)
    assert pool.lookup(other_parent) is None


def test_chained_keys_depend_on_the_whole_prefix():
    a = chain_keys([1, 2, 3, 4, 5, 6, 7, 8], 4, [])
    b = chain_keys([9, 2, 3, 4, 5, 6, 7, 8], 4, [])
    assert a[1].token_ids == b[1].token_ids and a[1].value != b[1].value
    assert block_key(None, [1, 2], extra="lora-a").value != block_key(None, [1, 2]).value


def test_cli_flag_turns_caching_off(folder, capsys):
    from twostep.cli import main

    rc = main(["generate", "--model", str(folder), "--no-enable-prefix-caching", "--max-tokens", "2",
               "--kv-cache-memory", "2MiB", "hello"])
    assert rc == 0 and "(0 cached)" in capsys.readouterr().err


def test_lookups_of_waiting_requests_are_counted_once(folder):
    """A request that waits for blocks is looked up again each step; only the lookup that
    admits it counts (the audit found 1,109 queried tokens for 80 prompt tokens)."""
    # The first request holds 5 of the 6 blocks (70 + 8 tokens) and never needs a sixth; the
    # second (40 tokens, 3 blocks) waits, looked up every step, until the first finishes.
    engine = engine_for(folder, num_kv_blocks=6, max_num_batched_tokens=128)
    prompts = [tokens(70, 50), tokens(40, 51)]
    outs = run(engine, prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert sum(o.metrics.num_preemptions for o in outs) == 0
    assert outs[1].metrics.first_scheduled_time >= outs[0].metrics.finished_time, "the second waited"
    stats = engine.get_stats()
    assert stats["prefix_cache_queries"] == 110 and stats["prefix_cache_hits"] == 0
    again = run(engine, [prompts[0]])[0]
    assert engine.get_stats()["prefix_cache_queries"] - stats["prefix_cache_queries"] == 70
    assert engine.get_stats()["prefix_cache_hits"] - stats["prefix_cache_hits"] == again.num_cached_tokens
