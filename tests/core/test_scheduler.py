"""The scheduler with no model (vLLM's tests/v1/core/test_scheduler.py is the model): hand-made
requests, schedule(), a hand-made ModelRunnerOutput, then what update_from_output does to tokens,
blocks, preemption and finishing."""
from __future__ import annotations

import torch

from twostep.core.scheduling.scheduler_output import SchedulerOutput
from twostep.core.step_outputs import ModelRunnerOutput, StepResult
from twostep.core.scheduling.request import Request, RequestStatus
from twostep.core.scheduling.scheduler import Scheduler
from twostep.kv.block_pool import NULL_BLOCK_ID
from twostep.kv.kv_cache_manager import KVCacheManager
from twostep.outputs import RequestMetrics, SpecDecodeStats
from twostep.sampling_params import SamplingParams

EOS = 2
BLOCK = 4


def make_request(rid: str, prompt_len: int, max_tokens: int = 8, max_model_len: int = 64,
                 prompt: list[int] | None = None, **params) -> Request:
    p = SamplingParams(temperature=0, max_tokens=max_tokens, **params)
    p.all_stop_token_ids = set() if p.ignore_eos else {EOS}
    seed = sum(map(ord, rid))
    prompt = list(prompt) if prompt else [100 + (seed + 7 * i) % 50 for i in range(prompt_len)]
    return Request(rid, prompt, p, RequestMetrics(arrival_time=0.0, num_prompt_tokens=prompt_len,
                                                   spec_decode=SpecDecodeStats()),
                   max_total_tokens=min(prompt_len + max_tokens, max_model_len))


def make_scheduler(num_blocks: int = 64, budget: int = 32, max_num_seqs: int = 8,
                   prefix_caching: bool = True) -> Scheduler:
    return Scheduler(KVCacheManager(num_blocks, BLOCK, prefix_caching), max_num_seqs, budget)


def runner_output(out: SchedulerOutput, tokens: dict[str, list[int]] | None = None,
                  accepted: dict[str, int] | None = None) -> ModelRunnerOutput:
    """What a model would return: a token for every request that completes its known tokens
    (tokens[rid] when given, else 7), none for a prefill chunk that does not."""
    tokens, accepted = tokens or {}, accepted or {}
    results = []
    for s in out.scheduled:
        rid = s.request.request_id
        sampled = s.completes_known_tokens or s.spec_token_ids
        results.append(StepResult(token_ids=tokens.get(rid, [7]) if sampled else [],
                                  num_accepted=accepted.get(rid, 0)))
    return ModelRunnerOutput(results)


def step(scheduler: Scheduler, tokens=None, accepted=None):
    out = scheduler.schedule()
    core = scheduler.update_from_output(out, runner_output(out, tokens, accepted))
    scheduler.kv.check_integrity()
    return out, {c.request_id: c for c in core}


def all_blocks_free(scheduler: Scheduler) -> bool:
    return scheduler.kv.num_free_blocks == scheduler.kv.num_blocks


def test_a_prompt_is_prefilled_then_decoded_one_token_a_step():
    scheduler = make_scheduler()
    request = make_request("a", 10)
    scheduler.add_request(request)
    out, core = step(scheduler, {"a": [11]})
    (s,) = out.scheduled
    assert (s.num_tokens, s.start, s.is_decode) == (10, 0, False)
    assert len(s.tables[0]) == 3 and NULL_BLOCK_ID not in s.tables[0]   # ceil(10 / 4)
    assert request.num_computed_tokens == 10 and request.output_token_ids == [11]
    assert core["a"].new_token_ids == [11] and core["a"].finish_reason is None
    out, core = step(scheduler, {"a": [12]})
    (s,) = out.scheduled
    assert (s.num_tokens, s.start, s.is_decode) == (1, 10, True)
    assert request.all_token_ids[-2:] == [11, 12] and request.num_computed_tokens == 11
    assert scheduler.stats.num_steps == 2 and scheduler.stats.num_prefill_tokens == 10


def test_a_long_prompt_is_chunked_and_samples_only_at_its_end():
    scheduler = make_scheduler(budget=4)
    request = make_request("a", 10)
    scheduler.add_request(request)
    sizes = []
    for _ in range(3):
        out, core = step(scheduler)
        sizes.append(out.scheduled[0].num_tokens)
    assert sizes == [4, 4, 2]
    assert request.output_token_ids == [7] and request.num_computed_tokens == 10


def test_decodes_go_first_and_prefills_take_what_is_left():
    scheduler = make_scheduler(budget=5)
    scheduler.add_request(make_request("old", 3))
    step(scheduler)                                # "old" is decoding now
    scheduler.add_request(make_request("new", 20))
    out, _ = step(scheduler)
    assert [(s.request.request_id, s.num_tokens) for s in out.scheduled] == [("old", 1), ("new", 4)]


def test_eos_stops_and_frees_the_blocks():
    scheduler = make_scheduler()
    request = make_request("a", 5)
    scheduler.add_request(request)
    _, core = step(scheduler, {"a": [EOS]})
    assert (core["a"].finish_reason, core["a"].stop_reason) == ("stop", None)
    assert request.status == RequestStatus.FINISHED and "a" not in scheduler.requests
    assert all_blocks_free(scheduler) and not scheduler.has_unfinished()
    assert scheduler.take_released() == ["a"]


def test_min_tokens_holds_eos_back_and_stop_token_ids_name_themselves():
    scheduler = make_scheduler()
    held, named = make_request("held", 4, min_tokens=2), make_request("named", 4, stop_token_ids=[9])
    scheduler.add_request(held)
    scheduler.add_request(named)
    _, core = step(scheduler, {"held": [EOS], "named": [9]})
    assert core["held"].finish_reason is None and held.output_token_ids == [EOS]
    assert (core["named"].finish_reason, core["named"].stop_reason) == ("stop", 9)
    _, core = step(scheduler, {"held": [EOS]})
    assert core["held"].finish_reason == "stop"


def test_max_tokens_ends_with_length():
    scheduler = make_scheduler()
    request = make_request("a", 4, max_tokens=2)
    scheduler.add_request(request)
    step(scheduler)
    _, core = step(scheduler)
    assert core["a"].finish_reason == "length" and len(request.output_token_ids) == 2
    assert all_blocks_free(scheduler)


def test_a_full_cache_preempts_the_newest_request_and_recomputes_it():
    scheduler = make_scheduler(num_blocks=4, budget=64)
    first, second = make_request("first", 8, max_tokens=20), make_request("second", 7, max_tokens=20)
    scheduler.add_request(first)
    scheduler.add_request(second)
    step(scheduler)                  # 2 + 2 blocks: the pool is full
    assert scheduler.kv.num_free_blocks == 0
    out, _ = step(scheduler)         # first's 9th token needs a third block: second makes room
    assert out.preempted == [second] and second.status == RequestStatus.PREEMPTED
    assert second.num_computed_tokens == 0 and scheduler.waiting[0] is second
    assert scheduler.kv.num_blocks_of("second") == 0 and scheduler.stats.num_preemptions == 1
    assert second.metrics.num_preemptions == 1 and "second" in scheduler.take_released()
    assert [s.request for s in out.scheduled] == [first]


def test_a_request_that_outgrows_the_whole_cache_alone_ends_with_length():
    scheduler = make_scheduler(num_blocks=2, budget=64)
    request = make_request("a", 8, max_tokens=20)
    scheduler.add_request(request)
    step(scheduler)                  # 8 prompt tokens, 2 blocks: the whole cache
    out, core = step(scheduler)      # a 9th token has no block to go to
    assert out.finished == [request] and out.is_empty
    assert core["a"].finish_reason == "length" and request.is_finished
    assert all_blocks_free(scheduler)


def test_verified_drafts_are_appended_and_rejected_slots_released():
    scheduler = make_scheduler(budget=64)
    request = make_request("a", 6, max_tokens=20)
    scheduler.add_request(request)
    step(scheduler, {"a": [50]})                       # 6 computed, 7 known
    scheduler.update_draft_token_ids([request], [([51, 52, 53, 54], None)])
    out, core = step(scheduler, {"a": [51, 60]}, {"a": 1})   # 51 accepted, 52 rejected: 60 instead
    (s,) = out.scheduled
    assert (s.num_tokens, s.spec_token_ids) == (5, [51, 52, 53, 54])
    assert len(s.tables[0]) == 3                      # 11 slots reserved
    assert request.output_token_ids == [50, 51, 60] and core["a"].new_token_ids == [51, 60]
    assert request.num_computed_tokens == 6 + 1 + 1   # the decode's token and one accepted draft
    assert scheduler.kv.num_blocks_of("a") == 2       # the rejected drafts' block went back
    assert request.spec_token_ids == []
    assert request.metrics.spec_decode.num_accepted_tokens == 1
    assert scheduler.spec_stats.num_draft_tokens == 4


def test_a_stop_among_accepted_drafts_drops_the_tokens_after_it():
    scheduler = make_scheduler(budget=64)
    request = make_request("a", 5, max_tokens=20)
    scheduler.add_request(request)
    step(scheduler, {"a": [50]})
    scheduler.update_draft_token_ids([request], [([EOS, 52], torch.zeros(2, 8))])
    _, core = step(scheduler, {"a": [EOS, 52, 53]}, {"a": 2})
    assert core["a"].new_token_ids == [EOS] and core["a"].finish_reason == "stop"
    assert request.output_token_ids == [50, EOS] and all_blocks_free(scheduler)


def test_drafts_are_asked_only_of_decodes_with_room():
    scheduler = make_scheduler(budget=64)
    decoding, prefilling = make_request("d", 4, max_tokens=4), make_request("p", 40)
    scheduler.add_request(decoding)
    step(scheduler)
    scheduler.add_request(prefilling)
    scheduler.max_num_batched_tokens = 10
    step(scheduler)                                  # "p" is mid-prompt now, "d" has 2 of 4 tokens
    assert scheduler.draft_candidates(4) == [(decoding, 1)]   # the last token is the target's


def test_full_blocks_are_registered_for_the_next_request_with_the_same_prefix():
    scheduler = make_scheduler()
    first = make_request("first", 9)
    scheduler.add_request(first)
    step(scheduler, {"first": [EOS]})
    again = make_request("again", 9, prompt=first.prompt_token_ids)
    scheduler.add_request(again)
    out, _ = step(scheduler)
    assert out.scheduled[0].start == 8 and again.metrics.num_cached_tokens == 8
    assert scheduler.kv_stats()["prefix_cache_hits"] == 8


def test_finish_requests_ends_waiting_and_running_ones_and_ignores_unknown_ids():
    scheduler = make_scheduler(budget=6)
    running, waiting = make_request("running", 4), make_request("waiting", 30)
    scheduler.add_request(running)
    step(scheduler)
    scheduler.add_request(waiting)
    ended = scheduler.finish_requests(["running", "waiting", "nobody"], "abort")
    assert ended == [running, waiting]
    assert all(r.finish_reason == "abort" and r.is_finished for r in ended)
    assert not scheduler.has_unfinished() and not scheduler.requests and all_blocks_free(scheduler)
