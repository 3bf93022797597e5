"""Prefill/decode disaggregation with real processes on loopback ports: a prefill instance
(kv_producer), a decode instance (kv_consumer) and `twostep proxy` in front, driven by the official
openai client, against one plain instance of the same model. float32 everywhere, so every output
must be token-identical; then a prefill instance killed while its blocks wait, and clients that
leave in the middle."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from conftest import MODEL, ROOT, Server, free_port, make_tiny_model, metric, random_prompts, scrape

pytestmark = pytest.mark.slow

GREEDY = {"temperature": 0, "max_tokens": 24, "ignore_eos": True}
SAMPLED = {"temperature": 0.9, "top_p": 0.9, "seed": 5, "max_tokens": 24, "ignore_eos": True}


def producer_args(port: int, *extra: str, lease_s: float = 30.0) -> list[str]:
    config = {"kv_connector": "ZmqConnector", "kv_role": "kv_producer", "kv_port": port,
              "kv_connector_extra_config": {"lease_s": lease_s}}
    return ["--kv-transfer-config", json.dumps(config), *extra]


def consumer_args(policy: str = "fail", timeout_s: float = 10.0, *extra: str) -> list[str]:
    config = {"kv_connector": "ZmqConnector", "kv_role": "kv_consumer", "kv_load_failure_policy": policy,
              "kv_connector_extra_config": {"timeout_s": timeout_s}}
    return ["--kv-transfer-config", json.dumps(config), *extra]


class Proxy:
    """A `twostep proxy` subprocess."""

    def __init__(self, prefill: Server, decode: Server, log_dir) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"proxy-{self.port}.log"
        cmd = [sys.executable, "-m", "twostep.cli", "proxy", "--prefill", prefill.base,
               "--decode", decode.base, "--port", str(self.port)]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log_path.read_text()
            try:
                if httpx.get(self.base + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        pytest.fail(f"proxy not healthy:\n{self.log_path.read_text()}")

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base + "/v1", api_key="x", **kw)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(15)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    # big enough that a long generation takes seconds (the disconnect tests need that)
    return make_tiny_model(tmp_path_factory.mktemp("disagg"), "llama", hidden_size=256, intermediate_size=1024,
                           num_hidden_layers=8, max_position_embeddings=4096)


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return tmp_path_factory.mktemp("disagg-logs")


@pytest.fixture(scope="module", params=["auto", "int8"], ids=["kv-float32", "kv-int8"])
def setup(request, folder, logs):
    kv = ["--kv-cache-dtype", request.param, "--max-model-len", "4096", "--kv-cache-memory", "64MiB"]
    servers = [Server(folder, logs, *kv, *producer_args(free_port(), "--max-num-seqs", "1")),
               Server(folder, logs, *kv, *consumer_args()),
               Server(folder, logs, *kv)]
    proxy = Proxy(servers[0], servers[1], logs)
    yield request.param, *servers, proxy
    proxy.stop()
    for s in servers:
        s.terminate()


def completion_ids(client: openai.OpenAI, prompt: list[int], **params) -> list[str]:
    """The generated tokens as 'token_id:N' labels: exact ids, not text."""
    r = client.completions.create(model=MODEL, prompt=prompt, logprobs=0,
                                  extra_body={"return_tokens_as_token_ids": True, **_extra(params)},
                                  **_std(params))
    return r.choices[0].logprobs.tokens


def _std(params: dict) -> dict:
    return {k: v for k, v in params.items() if k in ("temperature", "top_p", "seed", "max_tokens")}


def _extra(params: dict) -> dict:
    return {k: v for k, v in params.items() if k not in _std(params)}


def plain(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base + "/v1", api_key="x")


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "seeded-sampled"])
def test_completions_through_the_proxy_match_one_instance(setup, params):
    _, prefill, decode, single, proxy = setup
    for prompt in random_prompts([5, 17, 40, 100], seed=8):
        got = completion_ids(proxy.client(), prompt, **params)
        assert got == completion_ids(plain(single), prompt, **params)
        assert len(got) == 24
    loads = metric(scrape(decode), "twostep:kv_transfer_num_loads")
    assert loads >= 4
    sent = metric(scrape(prefill), "twostep:kv_transfer_bytes_sent")
    assert sent > 0 and sent == metric(scrape(decode), "twostep:kv_transfer_bytes_received")
    assert metric(scrape(decode), "twostep:kv_transfer_load_seconds", "twostep:kv_transfer_load_seconds_count") >= 4


def test_chat_streamed_and_whole_through_the_proxy(setup):
    _, _, _, single, proxy = setup
    messages = [{"role": "user", "content": "Tell me about the sea and the sky."}]
    want = plain(single).chat.completions.create(model=MODEL, messages=messages, max_tokens=20,
                                                 temperature=0).choices[0].message.content
    got = proxy.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    assert got.choices[0].message.content == want
    stream = proxy.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=20,
                                                    temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want


def test_a_prompt_that_hits_the_producers_prefix_cache(setup):
    _, prefill, _, single, proxy = setup
    prompt = random_prompts([70], seed=21)[0]
    want = completion_ids(plain(single), prompt, **GREEDY)
    hits = metric(scrape(prefill), "twostep:prefix_cache_hits")
    assert completion_ids(proxy.client(), prompt, **GREEDY) == want
    assert completion_ids(proxy.client(), prompt, **GREEDY) == want
    assert metric(scrape(prefill), "twostep:prefix_cache_hits") >= hits + 64


def wait_for(check, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def idle(server: Server) -> bool:
    m = scrape(server)
    return (metric(m, "twostep:num_requests_running") == 0 and metric(m, "twostep:num_requests_waiting") == 0
            and metric(m, "twostep:kv_cache_usage_perc") == 0)


def aborted(server: Server) -> float:
    return metric(scrape(server), "twostep:request_success", finished_reason="abort")


def test_client_leaving_mid_stream_aborts_the_decode(setup):
    kv, prefill, decode, _, proxy = setup
    if kv != "auto":
        pytest.skip("once is enough")
    before = aborted(decode)
    body = {"model": MODEL, "prompt": [5, 6, 7, 8], "max_tokens": 3000, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=30) as c, c.stream("POST", proxy.base + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        next(r.iter_lines())                       # the first chunk: decoding has started
    wait_for(lambda: aborted(decode) == before + 1, what="the decode instance to abort")
    wait_for(lambda: idle(decode) and idle(prefill), what="both instances to free their blocks")


def test_client_leaving_during_the_prefill_aborts_it(setup):
    """The prefill instance runs one sequence at a time (--max-num-seqs 1): with a long request
    of its own in progress, the proxied request waits there; the client gives up."""
    kv, prefill, decode, _, proxy = setup
    if kv != "auto":
        pytest.skip("once is enough")
    before = aborted(prefill)
    busy = {"model": MODEL, "prompt": [9, 10], "max_tokens": 3000, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=30) as c, c.stream("POST", prefill.base + "/v1/completions", json=busy) as r:
        lines = r.iter_lines()             # kept: a dropped iterator closes the stream
        next(lines)
        with pytest.raises(httpx.TimeoutException):
            httpx.post(proxy.base + "/v1/completions", json={"model": MODEL, "prompt": [5, 6], "max_tokens": 4},
                       timeout=1.0)
        wait_for(lambda: aborted(prefill) == before + 1, what="the prefill instance to abort the waiting request")
        assert metric(scrape(decode), "twostep:num_requests_waiting") == 0
    wait_for(lambda: idle(prefill) and idle(decode), what="both instances idle")


# ---- a prefill instance that dies while its blocks wait for the decode instance ------------------

@pytest.fixture(scope="module")
def doomed(folder, logs):
    kv = ["--max-model-len", "4096", "--kv-cache-memory", "64MiB"]
    servers = {"prefill": Server(folder, logs, *kv, *producer_args(free_port())),
               "fail": Server(folder, logs, *kv, *consumer_args("fail", 2.0)),
               "recompute": Server(folder, logs, *kv, *consumer_args("recompute", 2.0)),
               "single": Server(folder, logs, *kv)}
    yield servers
    for s in servers.values():
        s.kill()


def test_prefill_instance_killed_mid_transfer(doomed):
    prompt = random_prompts([45], seed=13)[0]
    body = {"model": MODEL, "prompt": prompt, **GREEDY}
    first = httpx.post(doomed["prefill"].base + "/v1/completions", timeout=30,
                       json={**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    assert first.status_code == 200, first.text
    kv = first.json()["kv_transfer_params"]
    assert kv["do_remote_prefill"] and kv["num_prompt_tokens"] == len(prompt)
    doomed["prefill"].kill()                       # the blocks the decode instance needs are gone

    failed = httpx.post(doomed["fail"].base + "/v1/completions", json={**body, "kv_transfer_params": kv}, timeout=30)
    assert failed.status_code == 500, failed.text
    message = failed.json()["error"]["message"]
    assert "timed out" in message and f"tcp://127.0.0.1:{kv['remote_port']}" in message, message

    stream = {**body, "kv_transfer_params": kv, "stream": True}
    with httpx.Client(timeout=30) as c, c.stream("POST", doomed["fail"].base + "/v1/completions", json=stream) as r:
        lines = [line for line in r.iter_lines() if line.strip()]
    assert "timed out" in json.loads(lines[0].removeprefix("data: "))["error"]["message"]
    assert lines[-1] == "data: [DONE]"

    want = httpx.post(doomed["single"].base + "/v1/completions", json=body, timeout=30).json()
    got = httpx.post(doomed["recompute"].base + "/v1/completions", json={**body, "kv_transfer_params": kv},
                     timeout=30)
    assert got.status_code == 200, got.text
    assert got.json()["choices"][0]["text"] == want["choices"][0]["text"]

    for name in ("fail", "recompute"):
        server = doomed[name]
        assert metric(scrape(server), "twostep:kv_transfer_num_load_failures") >= 1
        wait_for(lambda: idle(server), what=f"the {name} instance to free every block")
        assert server.proc.poll() is None


def test_bad_transfer_parameters_are_400(doomed):
    r = httpx.post(doomed["fail"].base + "/v1/completions", timeout=30,
                   json={"model": MODEL, "prompt": [5, 6], "kv_transfer_params": {"do_remote_prefill": True}})
    assert r.status_code == 400 and "need remote_engine_id" in r.json()["error"]["message"]
    r = httpx.post(doomed["single"].base + "/v1/completions", timeout=30,
                   json={"model": MODEL, "prompt": [5, 6], "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 400 and "--kv-transfer-config" in r.json()["error"]["message"]
    r = httpx.post(doomed["fail"].base + "/v1/completions", timeout=30,
                   json={"model": MODEL, "prompt": [[5, 6], [7, 8]], "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 400 and "one prompt" in r.json()["error"]["message"]


# ---- a decode instance that dies, and blocks nobody claims -------------------------------------

@pytest.fixture(scope="module")
def fragile(folder, logs):
    kv = ["--max-model-len", "4096", "--kv-cache-memory", "64MiB"]
    prefill = Server(folder, logs, *kv, *producer_args(free_port(), lease_s=1.0))
    decode = Server(folder, logs, *kv, *consumer_args())
    proxy = Proxy(prefill, decode, logs)
    yield prefill, decode, proxy
    proxy.stop()
    prefill.kill()
    decode.kill()


def test_unclaimed_blocks_are_freed_when_the_lease_ends(fragile):
    """A decode instance that never comes for its blocks (it died): the idle prefill instance
    frees them when the lease runs out."""
    prefill, _, _ = fragile
    r = httpx.post(prefill.base + "/v1/completions", timeout=30,
                   json={"model": MODEL, "prompt": random_prompts([60], seed=2)[0], "max_tokens": 1,
                         "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 200 and r.json()["kv_transfer_params"]["lease_s"] == 1.0
    assert metric(scrape(prefill), "twostep:kv_cache_usage_perc") > 0        # held for a consumer
    wait_for(lambda: idle(prefill), timeout=5, what="the lease to end")
    assert metric(scrape(prefill), "twostep:kv_transfer_num_leases_expired") == 1


def test_decode_instance_dying_mid_stream_ends_the_clients_stream(fragile):
    prefill, decode, proxy = fragile
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 3000, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=30) as c, c.stream("POST", proxy.base + "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        next(lines)
        decode.kill()
        rest = [line for line in lines if line.strip()]       # ends: no hang
    assert "broke off" in json.loads(rest[-1].removeprefix("data: "))["error"]["message"]
    wait_for(lambda: idle(prefill), what="the prefill instance to hold nothing")
