"""Engine replicas on Ray Serve behind one endpoint (`twostep serve --data-parallel-size 2 --ray-address`),
on a two-node Ray cluster the test starts on 127.0.0.1 (`ray start --head`, `ray start --address`), with
the real openai client: outputs equal one engine's, prefix-aware against round-robin routing, a replica
killed during 50 streams, 200 concurrent requests, the front's hardening, disaggregation as two pools,
and autoscaling.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import openai
import pytest

from conftest import Server, free_port, metric, scrape, serving

pytest.importorskip("ray.serve", reason="replicas need ray[serve] (requirements-test.txt)")
pytestmark = pytest.mark.slow

KEY = "sk-replicas"
# a test cluster on loopback: no usage reports, no token to share between its two nodes
RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
RAY = str(Path(sys.executable).with_name("ray"))
BLOCK = 16


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    """Two Ray nodes on this machine, a CPU each: the head and a second node that joins it."""
    log_dir = tmp_path_factory.mktemp("ray")
    port = free_port()
    env = {**os.environ, **RAY_ENV}
    common = ["--node-ip-address", "127.0.0.1", "--num-cpus", "1", "--block"]
    nodes = []
    with open(log_dir / "head.log", "wb") as log:
        nodes.append(subprocess.Popen([RAY, "start", "--head", "--port", str(port), "--include-dashboard=false",
                                       "--disable-usage-stats", *common], stdout=log, stderr=subprocess.STDOUT, env=env))
    address = f"127.0.0.1:{port}"
    _wait_for_nodes(address, 1, env, nodes, log_dir)
    with open(log_dir / "node.log", "wb") as log:
        nodes.append(subprocess.Popen([RAY, "start", "--address", address, *common],
                                      stdout=log, stderr=subprocess.STDOUT, env=env))
    _wait_for_nodes(address, 2, env, nodes, log_dir)
    try:
        yield address
    finally:
        for node in reversed(nodes):          # --block: SIGTERM stops the node's processes
            node.send_signal(signal.SIGTERM)
            try:
                node.wait(30)
            except subprocess.TimeoutExpired:
                node.kill()


def _wait_for_nodes(address: str, count: int, env: dict, nodes, log_dir: Path, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for node in nodes:
            assert node.poll() is None, "a ray node exited:\n" + "".join(
                p.read_text(errors="replace")[-3000:] for p in log_dir.glob("*.log"))
        status = subprocess.run([RAY, "status", "--address", address], capture_output=True, text=True, env=env)
        if status.returncode == 0 and status.stdout.count(" node_") >= count:
            return
        time.sleep(1)
    pytest.fail(f"the Ray cluster at {address} did not reach {count} nodes")


FRONT = {"env": RAY_ENV, "ready_timeout": 180.0, "stop_timeout": 60.0}


def start_args(address: str, *extra: str) -> list[str]:
    """Replicas of half a CPU: two fronts' replicas fit the two nodes at once."""
    return ["--ray-address", address, "--replica-cpus", "0.5", "--api-key", KEY, *extra]


@contextlib.contextmanager
def front_for(model, log_dir, address: str, *extra: str):
    yield from serving(model, log_dir, *start_args(address, *extra), **FRONT)


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def front(model, ray_cluster, tmp_path_factory):
    """Two replicas, prefix-aware routing."""
    yield from serving(model, tmp_path_factory.mktemp("front"),
                       *start_args(ray_cluster, "-dp", "2", "--max-request-body-bytes", "1048576"), **FRONT)


@pytest.fixture(autouse=True)
def _ray_env(monkeypatch):
    for k, v in RAY_ENV.items():
        monkeypatch.setenv(k, v)


def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url("/v1"), api_key=KEY, max_retries=0, timeout=120)


def post(server: Server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url(path), json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)


def replica_pids(server: Server) -> list[int]:
    """The processes of this server's replicas (Ray titles them by application)."""
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    tag = f"ServeReplica:twostep-{server.port}-"
    return [int(line.split()[0]) for line in out.splitlines() if tag in line]


def replicas_in_metrics(server: Server) -> set[str]:
    fam = scrape(server)["twostep:num_requests_running"]
    return {s.labels["replica"] for s in fam.samples}


# ---- one endpoint, the single engine's outputs ------------------------------------------------

PROMPTS = ["The quick brown fox", "Once upon a time", "1, 2, 3,"]
MESSAGES = [{"role": "user", "content": "Hello there!"}]


@pytest.fixture(scope="module")
def one_engine(model):
    """Greedy outputs of one engine in this process: the completions of PROMPTS, the chat of MESSAGES."""
    from twostep import LLM, SamplingParams

    llm = LLM(str(model), dtype="float32", kv_cache_memory="16MiB")
    params = SamplingParams(temperature=0.0, max_tokens=12)
    outputs = [o.outputs[0].text for o in llm.generate(PROMPTS, params)], llm.chat(MESSAGES, params)[0].outputs[0].text
    llm.shutdown()
    return outputs


def assert_same_outputs(server: Server, one_engine) -> None:
    expected, expected_chat = one_engine
    prompts, messages = PROMPTS, MESSAGES
    c = client(server)
    got = [c.completions.create(model="tiny", prompt=p, max_tokens=12, temperature=0).choices[0].text for p in prompts]
    assert got == expected
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model="tiny", prompt=prompts[0], max_tokens=12, temperature=0, stream=True))
    assert streamed == expected[0]
    chunks = list(c.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == expected_chat
    assert chunks[-1].usage.completion_tokens == 12


def test_completions_and_chat_through_one_endpoint_equal_one_engine(front, one_engine):
    assert_same_outputs(front, one_engine)
    assert len(replicas_in_metrics(front)) == 2


# ---- routing ---------------------------------------------------------------------------------------

def shared_prefix_workload() -> list[tuple[str, list[int]]]:
    """20 prompts sharing a 256-token prefix, an unrelated prompt after every second one."""
    import random

    rng = random.Random(7)
    prefix = [rng.randrange(10, 380) for _ in range(256)]
    work = []
    for i in range(20):
        work.append(("shared", prefix + [rng.randrange(10, 380) for _ in range(8)]))
        if i % 2 == 1:
            work.append(("other", [rng.randrange(10, 380) for _ in range(120)]))
    return work


def run_workload(server: Server) -> list[tuple[str, str, int, str]]:
    """(kind, replica, cached prompt tokens, routing decision) per request, sent one after another."""
    out = []
    for kind, prompt in shared_prefix_workload():
        r = post(server, "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200, r.text
        cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        out.append((kind, r.headers["x-twostep-replica"], cached, r.headers["x-twostep-routing"]))
    return out


@pytest.fixture(scope="module")
def prefix_aware_run(front):
    return run_workload(front)


def test_prefix_aware_routing_keeps_a_shared_prefix_on_one_replica(prefix_aware_run, front):
    shared = [r for r in prefix_aware_run if r[0] == "shared"]
    assert len({replica for _, replica, _, _ in shared}) == 1, shared
    assert all(cached >= 256 - BLOCK for _, _, cached, _ in shared[1:]), shared
    assert all(decision == "prefix" for *_, decision in shared[1:]), shared
    m = scrape(front)
    assert metric(m, "twostep:router_requests", decision="prefix") >= 19
    hits = metric(m, "twostep:prefix_cache_hits")
    assert hits >= 19 * (256 - BLOCK), hits       # the replicas' own counters agree with the headers


def test_round_robin_spreads_the_prefix_and_pays_for_it_on_each_replica(prefix_aware_run, model, ray_cluster,
                                                                        one_engine, tmp_path):
    # each replica tensor parallel as well (2 ranks, a quarter CPU each): still one engine's outputs
    with front_for(model, tmp_path, ray_cluster, "-dp", "2", "-tp", "2", "--replica-cpus", "0.25",
                   "--routing-policy", "round_robin") as rr:
        assert_same_outputs(rr, one_engine)
        rr_run = run_workload(rr)
    aware = [r for r in prefix_aware_run if r[0] == "shared"]
    robin = [r for r in rr_run if r[0] == "shared"]
    assert {decision for *_, decision in robin} == {"round_robin"}
    assert len({replica for _, replica, _, _ in robin}) == 2, robin
    misses = {name: sum(cached < 256 - BLOCK for _, _, cached, _ in run) for name, run in (("aware", aware),
                                                                                         ("robin", robin))}
    cached = {name: sum(c for _, _, c, _ in run) for name, run in (("aware", aware), ("robin", robin))}
    print(f"shared-prefix prompts: prefix misses {misses}, cached prompt tokens {cached}")
    assert misses["aware"] == 1 and misses["robin"] >= 2, misses   # each replica computed the prefix once
    assert cached["robin"] < cached["aware"], cached


def test_a_conversation_stays_on_its_replica(front):
    c = client(front)
    messages = [{"role": "system", "content": "You are a terse assistant. " * 3},
                {"role": "user", "content": "First question, about the sea?"}]
    replicas, cached = [], []
    for turn in range(3):
        raw = c.chat.completions.with_raw_response.create(model="tiny", messages=messages, max_tokens=6, temperature=0)
        reply = raw.parse()
        replicas.append(raw.headers["x-twostep-replica"])
        cached.append(reply.usage.prompt_tokens_details.cached_tokens)
        messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                     {"role": "user", "content": f"Follow-up number {turn}?"}]
    assert len(set(replicas)) == 1, replicas
    assert cached[0] == 0 and all(n > 0 for n in cached[1:]), cached


def test_a_stored_response_is_continued_on_the_replica_that_holds_it(front):
    c = client(front)
    first = c.responses.create(model="tiny", input="Tell me about the sea.", max_output_tokens=4, store=True)
    for i in range(6):        # other prompts: without the pin these could land on either replica
        follow = c.responses.create(model="tiny", input=f"and more, {i}?", previous_response_id=first.id,
                                    max_output_tokens=4)
        assert follow.status in ("completed", "incomplete")
    assert c.responses.retrieve(first.id).id == first.id
    messages = httpx.post(front.url("/v1/messages"), headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"},
                          json={"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]},
                          timeout=60)
    assert messages.status_code == 200 and messages.json()["type"] == "message"


# ---- the front's hardening -----------------------------------------------------------------------

def test_the_front_checks_key_and_size_and_replicas_answer_bad_input(front):
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
    assert httpx.post(front.url("/v1/completions"), json=body, timeout=30).status_code == 401
    assert httpx.get(front.url("/health"), timeout=30).status_code == 200        # open, as one server's
    big = post(front, "/v1/completions", {**body, "prompt": "x" * (2 << 20)})
    assert big.status_code == 413 and big.json()["error"]["code"] == 413
    bad = httpx.post(front.url("/v1/completions"), content=b"{not json", timeout=30,
                     headers={"Authorization": f"Bearer {KEY}", "content-type": "application/json"})
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "BadRequestError"
    too_long = post(front, "/v1/completions", {**body, "max_tokens": 10_000})
    assert too_long.status_code == 400, too_long.text
    models = client(front).models.list()
    assert [m.id for m in models.data] == ["tiny"]


def test_a_client_that_leaves_aborts_its_request_on_the_replica(front):
    body = {"model": "tiny", "prompt": "leave early", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", front.url("/v1/completions"), json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
    deadline = time.monotonic() + 10
    while metric(scrape(front), "twostep:num_requests_running") > 0:
        assert time.monotonic() < deadline, "the replica still runs a request whose client left"
        time.sleep(0.2)
    assert metric(scrape(front), "twostep:request_success", finished_reason="abort") >= 1


# ---- load, then a replica's death -----------------------------------------------------------------

def test_200_concurrent_requests_over_two_replicas_all_accounted_for(front):
    async def one(c: httpx.AsyncClient, i: int) -> tuple[int, str]:
        r = await c.post("/v1/completions", json={"model": "tiny", "prompt": f"request {i}:", "max_tokens": 8,
                                                  "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 8
        return i, r.headers["x-twostep-replica"]

    async def all_of_them():
        async with httpx.AsyncClient(base_url=front.base, timeout=180, headers={"Authorization": f"Bearer {KEY}"},
                                     limits=httpx.Limits(max_connections=200)) as c:
            return await asyncio.gather(*(one(c, i) for i in range(200)))

    results = asyncio.run(all_of_them())
    assert sorted(i for i, _ in results) == list(range(200))
    per_replica = Counter(replica for _, replica in results)
    assert len(per_replica) == 2 and min(per_replica.values()) >= 40, per_replica    # the load was shared
    m = scrape(front)
    for replica in replicas_in_metrics(front):       # every replica's KV pool free, nothing left running
        assert metric(m, "twostep:kv_cache_usage_perc", replica=replica) == 0
        assert metric(m, "twostep:num_requests_running", replica=replica) == 0
        assert metric(m, "twostep:num_requests_waiting", replica=replica) == 0


def read_stream(lines: list[str]) -> tuple[str, int]:
    """How a stream ended ("done", "error" or "cut") and its text chunks."""
    events = [line[len("data: "):] for line in lines if line.startswith("data: ")]
    if not events or events[-1] != "[DONE]":
        return "cut", len(events)
    payloads = [json.loads(e) for e in events[:-1]]
    if payloads and "error" in payloads[-1]:
        assert payloads[-1]["error"]["code"] == 503 and "replica" in payloads[-1]["error"]["message"]
        return "error", len(payloads) - 1
    return "done", len(payloads)


def test_a_replica_killed_during_50_streams(front):
    """Last of the module's tests on `front`: it kills a replica (Ray starts another)."""
    before = replica_pids(front)
    assert len(before) == 2, before

    async def stream(c: httpx.AsyncClient, i: int) -> tuple[str, str, int]:
        body = {"model": "tiny", "prompt": f"story {i}", "max_tokens": 300, "ignore_eos": True, "stream": True}
        async with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            text = (await r.aread()).decode()
        return (r.headers["x-twostep-replica"], *read_stream(text.split("\n")))

    async def run():
        async with httpx.AsyncClient(base_url=front.base, timeout=120, headers={"Authorization": f"Bearer {KEY}"},
                                     limits=httpx.Limits(max_connections=64)) as c:
            tasks = [asyncio.create_task(stream(c, i)) for i in range(50)]
            await asyncio.sleep(2.0)
            os.kill(before[0], signal.SIGKILL)
            return await asyncio.wait_for(asyncio.gather(*tasks), 120)   # none hangs

    results = asyncio.run(run())
    ends = Counter(end for _, end, _ in results)
    assert ends["cut"] == 0, results
    assert ends["error"] >= 1 and ends["done"] >= 1, ends     # the dead one's streams end with an error
    for replica, end, chunks in results:
        if end == "done":
            assert chunks >= 300
    for i in range(10):                                        # later requests go to live replicas
        r = post(front, "/v1/completions", {"model": "tiny", "prompt": f"after {i}", "max_tokens": 4})
        assert r.status_code == 200, r.text
    deadline = time.monotonic() + 120
    while len(replicas_in_metrics(front)) < 2 or len(replica_pids(front)) < 2:
        assert time.monotonic() < deadline, "Ray did not start the killed replica again"
        time.sleep(1)
    assert before[0] not in replica_pids(front)
    assert metric(scrape(front), "twostep:router_replica_failures") >= 1


# ---- disaggregation as two pools, autoscaling -----------------------------------------------------

def test_prefill_and_decode_pools(model, ray_cluster, one_engine, tmp_path):
    with front_for(model, tmp_path, ray_cluster, "--prefill-replicas", "1", "--decode-replicas", "1") as pd:
        assert_same_outputs(pd, one_engine)
        m = scrape(pd)
    replicas = {s.labels["replica"] for s in m["twostep:num_requests_running"].samples}
    assert len(replicas) == 2
    loads = {r: metric(m, "twostep:kv_transfer_num_loads", replica=r) for r in replicas}
    sent = {r: metric(m, "twostep:kv_transfer_bytes_sent", replica=r) for r in replicas}
    decode = max(loads, key=loads.get)
    assert loads[decode] >= 5 and sent[decode] == 0, (loads, sent)       # every request's KV came over
    prefill = (replicas - {decode}).pop()
    assert sent[prefill] > 0 and loads[prefill] == 0, (loads, sent)


def test_autoscaling_adds_a_replica_under_load(model, ray_cluster, tmp_path):
    import threading

    with front_for(model, tmp_path, ray_cluster, "--min-replicas", "1", "--max-replicas", "2",
                   "--target-ongoing-requests", "1") as auto:
        assert len(replica_pids(auto)) == 1
        stop, failures = threading.Event(), []

        def keep_busy() -> None:
            while not stop.is_set():
                r = post(auto, "/v1/completions", {"model": "tiny", "prompt": "busy", "max_tokens": 200,
                                                   "ignore_eos": True})
                if r.status_code != 200:
                    failures.append(r.text)

        workers = [threading.Thread(target=keep_busy) for _ in range(6)]
        for w in workers:
            w.start()
        try:
            deadline = time.monotonic() + 120
            while len(replicas_in_metrics(auto)) < 2:
                assert time.monotonic() < deadline, "Ray Serve did not add a replica under load"
                time.sleep(1)
        finally:
            stop.set()
            for w in workers:
                w.join()
        assert not failures, failures[:3]


def test_a_server_that_started_its_own_cluster_stops_it(model, tmp_path):
    with contextlib.closing(serving(model, tmp_path, "-dp", "2", "--replica-cpus", "0.5", **FRONT)) as servers:
        local = next(servers)                  # no --ray-address: a new local cluster on this machine
        r = httpx.post(local.url("/v1/completions"), json={"model": "tiny", "prompt": "hi", "max_tokens": 4},
                       timeout=60)
        assert r.status_code == 200, r.text
        assert len(replica_pids(local)) == 2
    deadline = time.monotonic() + 30           # exited 0 on SIGTERM (serving checks), replicas gone too
    while replica_pids(local):
        assert time.monotonic() < deadline, "the local cluster's replicas outlived the server"
        time.sleep(0.5)
