"""The scheduler talks to the runner in data (core/step_outputs.py's StepPlan): a request's data once,
then per step its tokens and new block ids. The runner's own state of each request must stay what
the scheduler holds, through chunked prefill, preemption, speculative verification and finishing,
and the plans must carry only what changed."""
from __future__ import annotations

import pytest

from conftest import GREEDY, engine_for, run_all
from twostep.core.step_outputs import StepPlan

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def watch_plans(engine) -> list[StepPlan]:
    """Every plan the runner executes, each checked against the scheduler's requests just after
    the runner applied it (before the scheduler changes them again)."""
    plans, runner, scheduler = [], engine.runner, engine.scheduler
    execute = runner.execute

    def checked(plan: StepPlan):
        out = execute(plan)
        plans.append(plan)
        for step, result in zip(plan.steps, out.results):
            state, request = runner.requests[step.request_id], scheduler.requests[step.request_id]
            assert state.tables == scheduler.kv.tables(step.request_id)
            assert state.prompt_token_ids == request.prompt_token_ids
            if step.samples or step.num_drafts:     # sampling read all the outputs, then added its own
                assert state.output_token_ids == request.output_token_ids + result.token_ids
        assert set(runner.requests) <= set(scheduler.requests), "the runner kept a forgotten request"
        return out

    runner.execute = checked
    return plans


@pytest.mark.parametrize("kw", [dict(max_num_batched_tokens=7),                                # chunks
                                dict(block_size=1, num_kv_blocks=120, max_num_batched_tokens=48),  # preemption
                                dict(speculative_config=NGRAM)])                                # drafts verified
def test_the_runner_state_follows_the_scheduler(reference, kw):
    folder, prompts, expected = reference
    engine = engine_for(folder, **kw)
    plans = watch_plans(engine)
    outs = run_all(engine, prompts)
    assert [o.outputs[0].token_ids for o in outs] == expected
    if "num_kv_blocks" in kw:
        assert engine.scheduler.num_preemptions > 0, "the cache was meant to be too small"
    assert any(p.removed for p in plans)
    engine.step()                                    # an empty step still drops the finished ones
    assert not engine.runner.requests and not engine.scheduler.requests


def test_plans_carry_only_what_changed(reference):
    folder, prompts, _ = reference
    engine = engine_for(folder, block_size=4)
    plans = watch_plans(engine)
    rid = engine.add_request(prompts[-1], GREEDY)
    while len(engine.scheduler.requests[rid].output_token_ids) < 12:
        engine.step()
    first, decodes = plans[0], plans[1:]
    assert [n.request_id for n in first.new_requests] == [rid]
    assert first.steps[0].block_start == 0 and first.steps[0].new_blocks[0] == engine.runner.requests[rid].tables[0][:len(first.steps[0].new_blocks[0])]
    for plan in decodes:                             # the request's data once; then a token a step
        (step,) = plan.steps
        assert not plan.new_requests and step.num_tokens == 1
        assert len(step.new_blocks[0]) <= 1          # a block only when one fills
    assert sum(len(p.steps[0].new_blocks[0]) for p in decodes) >= 2
