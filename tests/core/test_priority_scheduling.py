"""--scheduling-policy priority (vLLM's rule): lower priority values are admitted first and preempted
last; ties and the default policy stay first come, first served."""
from __future__ import annotations

import pytest

from conftest import engine_for
from twostep.sampling_params import SamplingParams

PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _finish_order(engine) -> list[str]:
    order = []
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step() if o.finished]
    return order


@pytest.fixture(scope="module")
def folder(tiny_model_dir):
    return tiny_model_dir("llama")


def test_lower_priority_values_go_first(folder):
    engine = engine_for(folder, max_num_seqs=1, scheduling_policy="priority")
    for rid, priority in (("a", 2), ("b", 0), ("c", 1), ("d", 0)):
        engine.add_request([5, 6, 7], PARAMS, request_id=rid, priority=priority)
    assert _finish_order(engine) == ["b", "d", "c", "a"]     # b and d tie: arrival order


def test_fcfs_takes_arrival_order_and_refuses_priorities(folder):
    engine = engine_for(folder, max_num_seqs=1)
    for rid in "abc":
        engine.add_request([5, 6, 7], PARAMS, request_id=rid)
    assert _finish_order(engine) == ["a", "b", "c"]
    with pytest.raises(ValueError, match="scheduling_policy 'priority'"):
        engine.add_request([5], PARAMS, priority=1)


@pytest.mark.parametrize("policy,victim", [("fcfs", "new"), ("priority", "old")])
def test_the_preempted_request_is_the_lowest_priority(folder, policy, victim):
    engine = engine_for(folder, num_kv_blocks=6, max_num_seqs=2, scheduling_policy=policy)
    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompt = list(range(10, 30))
    engine.add_request(prompt, long, request_id="old", priority=5 if policy == "priority" else 0)
    engine.add_request(prompt, long, request_id="new", priority=0)
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    preempted = {rid: o.metrics.num_preemptions for rid, o in outs.items()}
    assert preempted[victim] > 0 and preempted[({"old", "new"} - {victim}).pop()] == 0
    assert all(len(o.outputs[0].token_ids) == 40 for o in outs.values())
