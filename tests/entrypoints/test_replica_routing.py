"""The replicas' router without a cluster: the prefix index, the routing text of each API's body, the
policy's decisions, the error tail of a stream whose replica died, the merged /metrics."""
from __future__ import annotations

import json

import pytest

from twostep.entrypoints.openai.metrics import ServerMetrics
from twostep.entrypoints.replicas.prefix_index import BLOCK_CHARS, PrefixIndex, block_hashes
from twostep.entrypoints.replicas.routing_text import json_object, previous_response_id, routing_text

pytest.importorskip("ray.serve", reason="the router is a Ray Serve request router (requirements-test.txt)")

from twostep.entrypoints.replicas.front import stream_error_tail  # noqa: E402
from twostep.entrypoints.replicas.front_metrics import FrontMetrics  # noqa: E402
from twostep.entrypoints.replicas.router import RouteTicket, TwostepRouter  # noqa: E402


def text(n_blocks: int, seed: str = "a") -> str:
    return "".join(f"{seed}{i:03d}".ljust(BLOCK_CHARS, ".") for i in range(n_blocks))


def test_a_block_matches_only_where_everything_before_it_matches():
    index = PrefixIndex()
    index.insert("r1", block_hashes(text(4)))
    assert index.match("r1", block_hashes(text(4))).blocks == 4
    assert index.match("r1", block_hashes(text(6))).blocks == 4              # a longer prompt: its prefix
    changed_first = "X" + text(4)[1:]
    assert index.match("r1", block_hashes(changed_first)).blocks == 0        # same later blocks, other start
    assert index.match("r2", block_hashes(text(4))).blocks == 0
    assert block_hashes("x" * (BLOCK_CHARS - 1)) == []                       # no whole block, nothing cached
    assert index.match("r1", block_hashes(text(4))).ratio == 1.0


def test_the_index_forgets_the_least_recently_used_blocks():
    index = PrefixIndex(max_blocks_per_replica=8)
    index.insert("r", block_hashes(text(6, "a")))
    index.insert("r", block_hashes(text(6, "b")))
    assert index.size("r") == 8
    assert index.match("r", block_hashes(text(6, "b"))).blocks == 6
    assert index.match("r", block_hashes(text(6, "a"))).blocks == 0          # its first blocks went first
    index.forget("r")
    assert index.size("r") == 0


def body(**kw) -> dict:
    return json_object(json.dumps(kw).encode())


def test_routing_text_follows_the_prompt_order_of_each_api():
    system = {"role": "system", "content": "You answer in French. " * 10}
    turn1 = [system, {"role": "user", "content": "Hi"}]
    turn2 = turn1 + [{"role": "assistant", "content": "Salut"}, {"role": "user", "content": "How are you?"}]
    assert routing_text(body(messages=turn2)).startswith(routing_text(body(messages=turn1)))   # a chat's turns
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert routing_text(body(tools=tools, messages=turn1)).startswith(json.dumps(tools[0], sort_keys=True))
    assert routing_text(body(prompt="Once upon")) == "Once upon"
    assert routing_text(body(prompt=[1, 2, 3])) == "1 2 3"                     # token ids
    assert routing_text(body(system="Be brief.", messages=turn1)).startswith("Be brief.")        # Anthropic
    assert routing_text(body(instructions="Be brief.", input="Hi")) == "Be brief.Hi"              # Responses
    assert routing_text(body(input=["a", "b"])) == "a\x1eb\x1e"                                   # embeddings
    for bad in (b"", b"{not json", b"[1, 2]", b"null", b"[" * 100_000):
        assert routing_text(json_object(bad)) == ""
    assert previous_response_id(body(previous_response_id="resp_1", input="x")) == "resp_1"
    assert previous_response_id(body(previous_response_id=7)) is None


def router(policy: str = "prefix_aware", imbalance: int = 2) -> TwostepRouter:
    r = TwostepRouter.__new__(TwostepRouter)         # the policy alone, without Ray's routing loop
    r.initialize_state(policy=policy, imbalance=imbalance)
    return r


def test_prefix_affinity_then_least_loaded_then_balance():
    r = router()
    shared = text(8)
    first = RouteTicket(shared)
    assert r.choose(first, ["a", "b"]) == "a" and first.decision == "least_loaded"
    r._assign("req-1", "a", first)
    second = RouteTicket(shared + "and a question")
    assert r.choose(second, ["b", "a"]) == "a"             # b is less loaded; a holds the prefix
    assert second.decision == "prefix" and second.match.blocks == 8
    r.ongoing["a"], r.ongoing["b"] = 4, 0
    third = RouteTicket(shared)
    assert r.choose(third, ["b", "a"]) == "b" and third.decision == "balance"    # a leads by more than 2
    r.on_request_completed(_Id("a"), "req-1")
    assert r.ongoing["a"] == 3


def test_a_busy_replica_gives_way_to_the_best_match_among_the_others():
    r = router(imbalance=2)
    r.index.insert("a", block_hashes(text(8)))
    r.index.insert("b", block_hashes(text(3)))
    r.ongoing["a"], r.ongoing["b"], r.ongoing["c"] = 5, 1, 0
    ticket = RouteTicket(text(8))
    assert r.choose(ticket, ["c", "b", "a"]) == "b"          # a is too busy; b holds more than c
    assert ticket.decision == "balance" and ticket.match.blocks == 3
    r.ongoing["a"] = 2
    assert r.choose(RouteTicket(text(8)), ["c", "b", "a"]) == "a"


def test_in_flight_counts_only_what_a_replica_was_sent():
    r = router()
    ticket = RouteTicket(text(2))
    r._assign("req", "a", ticket)
    r.on_request_completed(_Id("a"), "broadcast-1")      # a broadcast's call was never counted
    assert r.ongoing["a"] == 1
    r._assign("req", "b", ticket)                          # a retry moved it: a is free again
    assert (r.ongoing["a"], r.ongoing["b"]) == (0, 1)
    r.on_request_completed(_Id("a"), "req")               # the failed attempt's late completion
    assert r.ongoing["b"] == 1
    r.on_request_completed(_Id("b"), "req")
    assert r.ongoing["b"] == 0 and not r.assigned
    r._assign("gone", "a", ticket)
    r._release("gone", None)                               # cancelled before it was sent
    assert r.ongoing["a"] == 0 and not r.assigned


def test_round_robin_and_pins():
    r = router("round_robin")
    picks = [r.choose(RouteTicket(text(4)), ["b", "a"]) for _ in range(4)]
    assert sorted(picks) == ["a", "a", "b", "b"] and picks[0] != picks[1]
    pinned = RouteTicket(text(4), pin="b")
    assert r.choose(pinned, ["a", "b"]) == "b" and pinned.decision == "pinned"
    gone = RouteTicket(text(4), pin="z")                    # the pinned replica died: routed as usual
    assert r.choose(gone, ["a", "b"]) in ("a", "b") and gone.decision == "round_robin"


def test_a_ticket_reaches_the_replica_without_its_text():
    import pickle

    ticket = RouteTicket("a long prompt" * 1000, pin="a")
    assert pickle.loads(pickle.dumps(ticket)) == RouteTicket()


@pytest.mark.parametrize("path, ends_with_done", [("/v1/chat/completions", True), ("/v1/completions", True),
                                                  ("/v1/messages", False), ("/v1/responses", False)])
def test_a_stream_whose_replica_died_ends_in_its_api_shape(path, ends_with_done):
    tail = stream_error_tail(path, "replica x failed").decode()
    assert tail.endswith("\n\n") and ("data: [DONE]" in tail) == ends_with_done
    data = json.loads(tail.split("data: ")[1].split("\n")[0])
    if path == "/v1/messages":
        assert tail.startswith("event: error") and data["error"]["type"] == "overloaded_error"   # 529: its SDKs retry
    elif path == "/v1/responses":
        assert data["type"] == "error" and data["code"] == "server_error"
    else:
        assert data["error"]["code"] == 503


def test_metrics_of_every_replica_under_a_replica_label():
    from prometheus_client.parser import text_string_to_metric_families

    one, two = ServerMetrics("m"), ServerMetrics("m")
    one.prompt_tokens.labels("m").inc(5)
    two.prompt_tokens.labels("m").inc(7)
    front = FrontMetrics()
    front.routed.labels("r1", "prefix").inc()
    families = {f.name: f for f in text_string_to_metric_families(
        front.render({"r1": one.render().decode(), "r2": two.render().decode()}).decode())}
    samples = {s.labels["replica"]: s.value for s in families["twostep:prompt_tokens"].samples
               if s.name == "twostep:prompt_tokens_total"}
    assert samples == {"r1": 5.0, "r2": 7.0}
    assert [s.value for s in families["twostep:router_requests"].samples if s.name.endswith("_total")] == [1.0]


class _Id:
    def __init__(self, unique_id: str) -> None:
        self.unique_id = unique_id
