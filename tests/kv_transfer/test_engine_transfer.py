"""Prefill/decode disaggregation between two real engines in one process: a producer prefills
(max_tokens 1, do_remote_decode) and holds its blocks; a consumer loads them over pyzmq on
loopback and decodes. Outputs must be token-identical to one engine doing everything (float32),
and both block pools must be whole and free afterwards, whatever went wrong."""
from __future__ import annotations

import dataclasses
import time

import pytest

from conftest import engine_for, random_prompts
from twostep import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=24, ignore_eos=True, seed=7)


def producer(folder, **kw):
    extra = kw.pop("extra", {})
    return engine_for(folder, kv_transfer_config={"kv_role": "kv_producer", "kv_port": 0,
                                                  "kv_connector_extra_config": extra}, **kw)


def consumer(folder, policy="fail", timeout_s=2.0, **kw):
    return engine_for(folder, kv_transfer_config={"kv_role": "kv_consumer", "kv_load_failure_policy": policy,
                                                  "kv_connector_extra_config": {"timeout_s": timeout_s}}, **kw)


def with_transfer(params: SamplingParams, kv: dict) -> SamplingParams:
    return dataclasses.replace(params, extra_args={"kv_transfer_params": kv})


def finish(engine, request_id: str, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    final = None
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "engine did not finish"
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                final = out
        engine.scheduler.kv.check_integrity()
    return final


def prefill(prod, prompt, params=GREEDY) -> dict:
    one = dataclasses.replace(params, max_tokens=1)
    rid = prod.add_request(prompt, with_transfer(one, {"do_remote_decode": True}))
    out = finish(prod, rid)
    assert out.kv_transfer_params["do_remote_prefill"] is True
    return out.kv_transfer_params


def decode(cons, prompt, kv: dict, params=GREEDY):
    rid = cons.add_request(prompt, with_transfer(params, kv))
    return finish(cons, rid)


def drain_leases(engine, timeout: float = 5.0) -> None:
    """Steps until the producer has freed every block it held for consumers."""
    deadline = time.monotonic() + timeout
    while engine.scheduler.sending:
        assert time.monotonic() < deadline, f"blocks still held: {list(engine.scheduler.sending)}"
        engine.step()
        time.sleep(0.01)


def assert_all_free(engine) -> None:
    kv = engine.scheduler.kv
    kv.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks, "blocks leaked"


@pytest.fixture(scope="module")
def folder(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def pair(folder):
    prod, cons = producer(folder), consumer(folder)
    yield prod, cons
    prod.shutdown()
    cons.shutdown()


@pytest.fixture(scope="module")
def single(folder):
    return engine_for(folder)


def local(engine, prompt, params):
    rid = engine.add_request(prompt, params)
    return finish(engine, rid)


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "seeded-sampled"])
def test_transfer_matches_one_engine(pair, single, params):
    prod, cons = pair
    for prompt in random_prompts([5, 16, 17, 40, 64], seed=3):
        kv = prefill(prod, prompt, params)
        out = decode(cons, prompt, kv, params)
        want = local(single, prompt, params)
        assert out.outputs[0].token_ids == want.outputs[0].token_ids
        m = out.metrics
        assert m.num_remote_tokens == len(prompt) - 1 - m.num_cached_tokens
        assert m.kv_transfer_bytes > 0 and m.kv_load_end_time >= m.kv_load_start_time
    drain_leases(prod)
    assert_all_free(prod)
    assert_all_free(cons)
    stats = cons.get_stats()
    assert stats["kv_transfer_num_loads"] >= 5 and stats["kv_transfer_bytes_received"] > 0
    assert prod.get_stats()["kv_transfer_bytes_sent"] == stats["kv_transfer_bytes_received"]


def test_prefix_cache_hits_on_both_sides(pair, single):
    """The same long prompt twice: the producer's second prefill hits its prefix cache, the
    consumer's second load pulls only the blocks its own cache lacks; outputs stay identical."""
    prod, cons = pair
    cons.reset_prefix_cache()
    base = random_prompts([48], seed=11)[0]
    want = local(single, base, GREEDY).outputs[0].token_ids
    first = decode(cons, base, prefill(prod, base))
    assert first.outputs[0].token_ids == want
    again = prefill(prod, base)
    second = decode(cons, base, again)
    assert second.outputs[0].token_ids == want
    assert second.metrics.num_cached_tokens == 32           # two of three full blocks were local
    assert second.metrics.num_remote_tokens == 48 - 1 - 32
    drain_leases(prod)
    assert prod.get_stats()["prefix_cache_hits"] > 0
    assert_all_free(prod)
    assert_all_free(cons)


def test_8bit_kv_sends_its_scales(folder):
    prod, cons = producer(folder, kv_cache_dtype="int8"), consumer(folder, kv_cache_dtype="int8")
    single = engine_for(folder, kv_cache_dtype="int8")
    try:
        for prompt in random_prompts([9, 33], seed=5):
            out = decode(cons, prompt, prefill(prod, prompt))
            assert out.outputs[0].token_ids == local(single, prompt, GREEDY).outputs[0].token_ids
        drain_leases(prod)
        assert_all_free(cons)
    finally:
        prod.shutdown()
        cons.shutdown()


def test_layout_mismatch_is_refused_at_handshake(folder):
    prod, cons = producer(folder, block_size=16), consumer(folder, block_size=32)
    try:
        prompt = random_prompts([40], seed=2)[0]
        kv = prefill(prod, prompt)
        kv["remote_block_ids"] = kv["remote_block_ids"][:2]   # as many blocks as 32-token blocks need
        out = decode(cons, prompt, kv)
        c = out.outputs[0]
        assert c.finish_reason == "error"
        assert "block_size 32 here, 16 there" in c.stop_reason
        assert_all_free(cons)
    finally:
        prod.shutdown()
        cons.shutdown()


def test_producer_gone_fail_and_recompute(folder, single):
    """The prefill instance stops serving after its prefill: with policy fail the request ends
    with a clear error, with recompute it is computed locally and right; no block is left held."""
    prompt = random_prompts([30], seed=9)[0]
    want = local(single, prompt, GREEDY).outputs[0].token_ids
    for policy in ("fail", "recompute"):
        prod, cons = producer(folder), consumer(folder, policy=policy, timeout_s=0.5)
        try:
            kv = prefill(prod, prompt)
            prod.shutdown()                           # no one answers at its address any more
            out = decode(cons, prompt, kv)
            c = out.outputs[0]
            if policy == "fail":
                assert c.finish_reason == "error" and "timed out" in c.stop_reason, c.stop_reason
                assert c.token_ids == []
            else:
                assert c.token_ids == want
            assert cons.get_stats()["kv_transfer_num_load_failures"] == 1
            assert_all_free(cons)
        finally:
            cons.shutdown()


def test_lease_expires_and_frees_the_blocks(folder):
    prod = producer(folder, extra={"lease_s": 0.3})
    try:
        kv = prefill(prod, random_prompts([20], seed=4)[0])
        assert prod.scheduler.sending and prod.has_pending_transfers()
        drain_leases(prod)
        assert prod.get_stats()["kv_transfer_num_leases_expired"] == 1
        assert_all_free(prod)
        cons = consumer(folder)
        try:
            out = decode(cons, random_prompts([20], seed=4)[0], kv)
            assert out.outputs[0].finish_reason == "error" and "lease expired" in out.outputs[0].stop_reason
        finally:
            cons.shutdown()
    finally:
        prod.shutdown()


def test_abort_while_loading_releases_everything(folder):
    prod, cons = producer(folder), consumer(folder)
    try:
        prompt = random_prompts([50], seed=6)[0]
        kv = prefill(prod, prompt)
        rid = cons.add_request(prompt, with_transfer(GREEDY, kv))
        cons.step()                                    # admitted: the load starts
        assert rid in cons.scheduler.loading
        cons.abort_request(rid)
        finish(cons, rid)
        time.sleep(0.2)
        cons.step()                                    # a late arrival is dropped, not written
        assert_all_free(cons)
        drain_leases(prod)                             # the consumer released the lease
        assert prod.get_stats()["kv_transfer_num_leases_expired"] == 0
        assert_all_free(prod)
    finally:
        prod.shutdown()
        cons.shutdown()


@pytest.mark.parametrize("kv, message", [
    ({"do_remote_prefill": True}, "need remote_engine_id"),
    ("yes", "must be an object"),
])
def test_bad_transfer_params_are_value_errors(pair, kv, message):
    _, cons = pair
    with pytest.raises(ValueError, match=message):
        cons.add_request([5, 6, 7], with_transfer(GREEDY, kv))
    assert not cons.has_unfinished_requests()


def test_params_for_another_prompt_are_refused(pair):
    prod, cons = pair
    kv = prefill(prod, [5, 6, 7, 8])
    with pytest.raises(ValueError, match="for another prompt"):
        cons.add_request([5, 6, 7, 9], with_transfer(GREEDY, kv))
    drain_leases_by_reading(cons, prod, [5, 6, 7, 8], kv)


def drain_leases_by_reading(cons, prod, prompt, kv) -> None:
    decode(cons, prompt, kv)
    drain_leases(prod)


def test_roles_are_checked(folder, pair):
    prod, cons = pair
    with pytest.raises(ValueError, match="needs kv_role kv_producer or kv_both"):
        cons.add_request([5, 6], with_transfer(GREEDY, {"do_remote_decode": True}))
    plain = engine_for(folder)
    with pytest.raises(ValueError, match="--kv-transfer-config"):
        plain.add_request([5, 6], with_transfer(GREEDY, {"do_remote_decode": True}))
    with pytest.raises(ValueError, match="n = 1"):
        prod.add_request([5, 6], with_transfer(dataclasses.replace(GREEDY, n=2), {"do_remote_decode": True}))


def test_a_waiting_consumer_keeps_the_lease_alive(folder, single):
    """The consumer runs one sequence at a time and is busy for longer than the producer's lease:
    the waiting request's lease is extended, so its blocks are still there when it is admitted."""
    prod = producer(folder, extra={"lease_s": 0.6})
    cons = consumer(folder, max_num_seqs=1)
    try:
        prompt = random_prompts([25], seed=14)[0]
        kv = prefill(prod, prompt)
        busy = cons.add_request([7, 8, 9], dataclasses.replace(GREEDY, max_tokens=400))
        rid = cons.add_request(prompt, with_transfer(GREEDY, kv))
        start = time.monotonic()
        while time.monotonic() - start < 1.5:          # two and a half leases
            cons.step()
            prod.step()                                # the producer would free expired blocks here
            time.sleep(0.005)
        assert rid in [r.request_id for r in cons.scheduler.waiting] and prod.scheduler.sending
        cons.abort_request(busy)
        out = finish(cons, rid)
        assert out.outputs[0].token_ids == local(single, prompt, GREEDY).outputs[0].token_ids
        assert prod.get_stats()["kv_transfer_num_leases_expired"] == 0
    finally:
        prod.shutdown()
        cons.shutdown()


def test_the_trace_shows_the_transfer(folder):
    prod, cons = producer(folder), consumer(folder)
    tracer = cons.enable_tracing()
    try:
        prompt = random_prompts([40], seed=15)[0]
        decode(cons, prompt, prefill(prod, prompt))
        spans = [e for e in tracer.events if e.get("name") == "kv transfer"]
        assert len(spans) == 1 and spans[0]["dur"] > 0
        assert spans[0]["args"]["remote_tokens"] == 39 and spans[0]["args"]["kv_transfer_bytes"] > 0
    finally:
        prod.shutdown()
        cons.shutdown()


def test_bad_messages_and_addresses_never_stop_the_threads(pair, single):
    """Anyone can reach a producer's port and name any address to a consumer: a malformed message
    gets an error answer, an address zmq refuses fails that load only, and both sides keep working."""
    import zmq

    prod, cons = pair
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{prod.kv_connector.port}")
    for junk in (b"not json", b"[1, 2]", b'{"op": "read", "request_id": ["x"]}',
                 b'{"op": "read", "request_id": "r", "first_block": 0, "num_blocks": -1}'):
        sock.send(junk)
        if junk.startswith(b"{"):
            assert sock.poll(2000), junk
            assert b'"ok": false' in sock.recv()
    sock.close()
    prompt = random_prompts([20], seed=17)[0]
    kv = prefill(prod, prompt)
    with pytest.raises(ValueError, match="remote_host"):
        cons.add_request(prompt, with_transfer(GREEDY, {**kv, "remote_host": "a b"}))
    with pytest.raises(ValueError, match="remote_port"):
        cons.add_request(prompt, with_transfer(GREEDY, {**kv, "remote_port": 70000}))
    out = decode(cons, prompt, kv)                   # both threads still serve
    assert out.outputs[0].token_ids == local(single, prompt, GREEDY).outputs[0].token_ids
    drain_leases(prod)


def test_vllm_only_keys_are_accepted(folder):
    from twostep.config import KVTransferConfig

    c = KVTransferConfig.parse({"kv_connector": "ZmqConnector", "kv_role": "kv_consumer", "kv_rank": 1,
                                "kv_parallel_size": 2, "kv_buffer_device": "cpu"})
    assert c.kv_role == "kv_consumer"
    with pytest.raises(ValueError, match="unknown kv transfer config keys"):
        KVTransferConfig.parse({"kv_role": "kv_consumer", "kv_bogus": 1})
