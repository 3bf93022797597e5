"""The prefill/decode disaggregation proxy (`twostep proxy`) before fake prefill and decode
instances: small FastAPI apps in uvicorn on loopback ports, in this process's threads, which record
what they get. What each instance sees, what the client gets back (through the official openai
client where it fits), round robin, errors passed on or made (400, 502, 503), client disconnects
cancelling the upstream request, /health, /v1/models, URL checks, and run_proxy in a subprocess."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from twostep.entrypoints.openai.disagg_proxy import ProxyConfig, RoundRobin, build_proxy_app, normalize_url

ROOT = Path(__file__).resolve().parents[2]
C, CH = "/v1/completions", "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "Hello"}]


# ---- fake instances ----------------------------------------------------------------------------

@dataclass
class Fake:
    """One fake instance: what it got, and how it should answer (tests set these; reset() clears)."""

    name: str
    bodies: list[dict] = field(default_factory=list)
    headers: list[dict] = field(default_factory=list)
    kv_answered: list[dict] = field(default_factory=list)   # prefill: the kv_transfer_params it sent
    delay: float = 0.0            # seconds to think before a JSON answer (watching for a disconnect)
    fail: bool = False            # prefill: answer a 400
    omit_kv: bool = False         # prefill: answer without kv_transfer_params
    chunk_delay: float = 0.01     # decode: seconds between stream chunks
    saw_disconnect: threading.Event = field(default_factory=threading.Event)
    stream_closed_early: threading.Event = field(default_factory=threading.Event)
    stream_finished: threading.Event = field(default_factory=threading.Event)
    base: str = ""

    def reset(self) -> None:
        for name in ("bodies", "headers", "kv_answered"):
            getattr(self, name).clear()
        self.delay, self.fail, self.omit_kv, self.chunk_delay = 0.0, False, False, 0.01
        for event in (self.saw_disconnect, self.stream_closed_early, self.stream_finished):
            event.clear()

    async def record(self, request: Request) -> dict:
        body = await request.json()
        self.bodies.append(body)
        self.headers.append(dict(request.headers))
        return body

    async def think(self, request: Request) -> bool:
        """Waits `delay` seconds; False (and saw_disconnect set) if the caller left meanwhile."""
        deadline = time.monotonic() + self.delay
        while time.monotonic() < deadline:
            if await request.is_disconnected():
                self.saw_disconnect.set()
                return False
            await asyncio.sleep(0.02)
        return True


BAD_PROMPT = {"error": {"message": "prompt is empty", "type": "BadRequestError", "param": "prompt", "code": 400}}
CHUNKS = 5


def answer(fake: Fake, chat: bool, text: str) -> dict:
    choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
              if chat else {"index": 0, "text": text, "finish_reason": "length", "logprobs": None})
    return {"id": f"{fake.name}-{uuid.uuid4().hex[:8]}", "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": "tiny", "choices": [choice],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}


def chunk(fake: Fake, chat: bool, i: int) -> dict:
    piece = f"{fake.name}:{i} "
    choice = ({"index": 0, "delta": {"content": piece}, "finish_reason": None} if chat
              else {"index": 0, "text": piece, "finish_reason": None, "logprobs": None})
    return {"id": f"{fake.name}-stream", "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": "tiny", "choices": [choice]}


def prefill_app(fake: Fake) -> FastAPI:
    app = FastAPI()

    async def prefill(request: Request):
        body = await fake.record(request)
        if not await fake.think(request):
            return JSONResponse({}, status_code=499)
        if fake.fail:
            return JSONResponse(BAD_PROMPT, status_code=400)
        out = answer(fake, request.url.path == CH, "x")
        if not fake.omit_kv:
            kv = {"do_remote_prefill": True, "remote_host": fake.name, "transfer_id": uuid.uuid4().hex}
            fake.kv_answered.append(kv)
            out["kv_transfer_params"] = kv
        assert body["stream"] is False
        return out

    app.post(C)(prefill)
    app.post(CH)(prefill)
    app.get("/health")(lambda: "")
    return app


def decode_app(fake: Fake) -> FastAPI:
    app = FastAPI()

    async def decode(request: Request):
        body = await fake.record(request)
        chat = request.url.path == CH
        if not body.get("stream"):
            if not await fake.think(request):
                return JSONResponse({}, status_code=499)
            return answer(fake, chat, f"decoded by {fake.name}")

        async def events():
            done = False
            try:
                for i in range(CHUNKS):
                    yield f"data: {json.dumps(chunk(fake, chat, i))}\n\n"
                    await asyncio.sleep(fake.chunk_delay)
                yield "data: [DONE]\n\n"
                done = True
                fake.stream_finished.set()
            finally:
                if not done:
                    fake.stream_closed_early.set()
        return StreamingResponse(events(), media_type="text/event-stream")

    app.post(C)(decode)
    app.post(CH)(decode)
    app.get("/health")(lambda: "")
    app.get("/v1/models")(lambda: {"object": "list", "data": [{"id": f"model-of-{fake.name}", "object": "model",
                                                                 "created": 0, "owned_by": "twostep"}]})
    return app


# ---- running apps on loopback ports ------------------------------------------------------------

@contextlib.contextmanager
def running(app: FastAPI):
    """The app in uvicorn on a free loopback port, in a thread; yields its base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
        assert not thread.is_alive(), "the server did not stop"


def dead_url() -> str:
    """A loopback URL where nothing listens."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@dataclass
class Cluster:
    prefill: list[Fake]
    decode: list[Fake]
    proxy: str

    def fakes(self) -> list[Fake]:
        return self.prefill + self.decode

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.proxy + "/v1", api_key="x", max_retries=0, timeout=10, **kw)

    def one(self, fakes: list[Fake]) -> Fake:
        """The one fake of these that got a request (the test sent one)."""
        got = [f for f in fakes if f.bodies]
        assert len(got) == 1 and len(got[0].bodies) == 1, [(f.name, f.bodies) for f in fakes]
        return got[0]


@pytest.fixture(scope="module")
def cluster():
    prefill, decode = [Fake("p0"), Fake("p1")], [Fake("d0"), Fake("d1")]
    with contextlib.ExitStack() as stack:
        for fake in prefill:
            fake.base = stack.enter_context(running(prefill_app(fake)))
        for fake in decode:
            fake.base = stack.enter_context(running(decode_app(fake)))
        config = ProxyConfig([f.base + "/v1" for f in prefill], [f.base + "/" for f in decode], timeout=30)
        yield Cluster(prefill, decode, stack.enter_context(running(build_proxy_app(config))))


@pytest.fixture(autouse=True)
def fresh(request):
    if "cluster" in request.fixturenames:
        for fake in request.getfixturevalue("cluster").fakes():
            fake.reset()


# ---- the two steps -----------------------------------------------------------------------------

def check_steps(cluster: Cluster, sent: dict, chat: bool) -> tuple[Fake, Fake]:
    """The prefill instance got the request for one whole token with do_remote_decode; the decode
    instance got the request as sent plus the kv_transfer_params the prefill instance answered."""
    p, d = cluster.one(cluster.prefill), cluster.one(cluster.decode)
    pre = p.bodies[0]
    assert pre["max_tokens"] == 1 and pre["stream"] is False
    assert pre["kv_transfer_params"] == {"do_remote_decode": True}
    assert "stream_options" not in pre
    changed = ("max_tokens", "max_completion_tokens", "min_tokens", "stream", "stream_options",
               "kv_transfer_params")
    assert {k: v for k, v in pre.items() if k not in changed} == {k: v for k, v in sent.items() if k not in changed}
    if chat and "max_completion_tokens" in sent:
        assert pre["max_completion_tokens"] == 1
    assert d.bodies[0] == {**sent, "kv_transfer_params": p.kv_answered[0]}
    return p, d


def test_completion(cluster):
    sent = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 20, "temperature": 0}
    out = cluster.client().completions.create(**sent)
    p, d = check_steps(cluster, sent, chat=False)
    assert out.choices[0].text == f"decoded by {d.name}"
    assert p.kv_answered[0]["remote_host"] == p.name


def test_chat(cluster):
    sent = {"model": "tiny", "messages": MESSAGES, "max_completion_tokens": 50, "n": 1}
    out = cluster.client().chat.completions.create(**sent)
    p, d = check_steps(cluster, sent, chat=True)
    assert out.choices[0].message.content == f"decoded by {d.name}"
    assert p.bodies[0]["max_tokens"] == 1 and p.bodies[0]["max_completion_tokens"] == 1


def test_completion_stream(cluster):
    sent = {"model": "tiny", "prompt": "Once", "max_tokens": 7, "stream": True, "min_tokens": 3}
    stream = cluster.client().completions.create(**{k: v for k, v in sent.items() if k != "min_tokens"},
                                                 extra_body={"min_tokens": 3})
    text = "".join(c.choices[0].text for c in stream)
    p, d = check_steps(cluster, sent, chat=False)
    assert "min_tokens" not in p.bodies[0]          # more than max_tokens 1 would be a 400
    assert text == "".join(f"{d.name}:{i} " for i in range(CHUNKS))
    # the fake marks its stream finished after its last chunk has gone out: the client can be first
    assert d.stream_finished.wait(3) and not d.stream_closed_early.is_set()


def test_chat_stream(cluster):
    sent = {"model": "tiny", "messages": MESSAGES, "max_tokens": 9, "stream": True,
            "stream_options": {"include_usage": True}}
    chunks = list(cluster.client().chat.completions.create(**sent))
    p, d = check_steps(cluster, sent, chat=True)
    assert "".join(c.choices[0].delta.content for c in chunks) == "".join(f"{d.name}:{i} " for i in range(CHUNKS))
    assert d.bodies[0]["stream_options"] == {"include_usage": True}


def test_stream_bytes_and_headers_pass_through(cluster):
    body = {"model": "tiny", "prompt": "Once", "max_tokens": 5, "stream": True}
    headers = {"Authorization": "Bearer secret", "X-Request-Id": "req-42"}
    with httpx.stream("POST", cluster.proxy + C, json=body, headers=headers, timeout=10) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    d = cluster.one(cluster.decode)
    events = raw.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""] and len(events) == CHUNKS + 2
    assert [json.loads(e[len("data: "):])["choices"][0]["text"] for e in events[:CHUNKS]] == \
        [f"{d.name}:{i} " for i in range(CHUNKS)]
    for fake in (cluster.one(cluster.prefill), d):
        assert fake.headers[0]["authorization"] == "Bearer secret"
        assert fake.headers[0]["x-request-id"] == "req-42"


def test_round_robin(cluster):
    client = cluster.client()
    for i in range(4):
        client.completions.create(model="tiny", prompt=f"p{i}", max_tokens=3)
    assert [len(f.bodies) for f in cluster.fakes()] == [2, 2, 2, 2]
    # each decode request carried the kv_transfer_params of the prefill that preceded it
    kv_sent = [b["kv_transfer_params"] for d in cluster.decode for b in d.bodies]
    kv_answered = [kv for p in cluster.prefill for kv in p.kv_answered]
    assert sorted(kv["transfer_id"] for kv in kv_sent) == sorted(kv["transfer_id"] for kv in kv_answered)
    assert len({kv["transfer_id"] for kv in kv_sent}) == 4


def test_round_robin_helper():
    rr = RoundRobin(["a", "b", "c"])
    assert [rr.next() for _ in range(7)] == ["a", "b", "c", "a", "b", "c", "a"]


# ---- errors ------------------------------------------------------------------------------------

def error_of(r: httpx.Response, status: int) -> str:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error["message"]


def test_prefill_error_passes_through(cluster):
    for fake in cluster.prefill:
        fake.fail = True
    r = httpx.post(cluster.proxy + C, json={"model": "tiny", "prompt": "", "max_tokens": 3}, timeout=10)
    assert r.status_code == 400 and r.json() == BAD_PROMPT
    with pytest.raises(openai.BadRequestError, match="prompt is empty"):
        cluster.client().chat.completions.create(model="tiny", messages=MESSAGES, stream=True)
    assert not any(d.bodies for d in cluster.decode)


def test_prefill_without_kv_transfer_params_is_502(cluster):
    for fake in cluster.prefill:
        fake.omit_kv = True
    r = httpx.post(cluster.proxy + C, json={"model": "tiny", "prompt": "a", "max_tokens": 3}, timeout=10)
    message = error_of(r, 502)
    p = cluster.one(cluster.prefill)
    assert "returned no kv_transfer_params" in message and p.base in message and "kv_producer" in message
    assert not any(d.bodies for d in cluster.decode)


def test_bad_json_and_unknown_route(cluster):
    r = httpx.post(cluster.proxy + C, content=b"{not json", headers={"content-type": "application/json"})
    assert "not valid JSON" in error_of(r, 400)
    assert "JSON object" in error_of(httpx.post(cluster.proxy + CH, json=[1, 2]), 400)
    error_of(httpx.get(cluster.proxy + "/v1/nothing"), 404)
    error_of(httpx.get(cluster.proxy + C), 405)
    assert not any(f.bodies for f in cluster.fakes())


def test_unreachable_instances_are_502(cluster):
    dead = dead_url()
    config = ProxyConfig([cluster.prefill[0].base], [dead])
    with running(build_proxy_app(config)) as proxy:
        for stream in (False, True):
            r = httpx.post(proxy + C, json={"model": "tiny", "prompt": "a", "max_tokens": 3, "stream": stream},
                           timeout=10)
            message = error_of(r, 502)
            assert f"decode instance {dead} is unreachable" in message, message
    with running(build_proxy_app(ProxyConfig([dead], [cluster.decode[0].base]))) as proxy:
        message = error_of(httpx.post(proxy + CH, json={"model": "tiny", "messages": MESSAGES}, timeout=10), 502)
        assert f"prefill instance {dead} is unreachable" in message, message
    assert not cluster.decode[0].bodies


# ---- clients that leave ------------------------------------------------------------------------

def test_client_leaving_mid_stream_closes_the_decode_stream(cluster):
    for fake in cluster.decode:
        fake.chunk_delay = 0.3             # the whole stream would take 1.5 s
    stream = cluster.client().completions.create(model="tiny", prompt="a", max_tokens=50, stream=True)
    first = next(iter(stream))
    stream.close()
    d = cluster.one(cluster.decode)
    assert first.choices[0].text == f"{d.name}:0 "
    assert d.stream_closed_early.wait(3), "the decode instance's stream went on"
    assert not d.stream_finished.is_set()


def test_client_leaving_during_prefill_cancels_it(cluster):
    for fake in cluster.prefill:
        fake.delay = 2.0
    start = time.monotonic()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(cluster.proxy + C, json={"model": "tiny", "prompt": "a", "max_tokens": 3},
                   timeout=httpx.Timeout(5, read=0.3))
    p = cluster.one(cluster.prefill)
    assert p.saw_disconnect.wait(3), "the prefill instance did not see the client go"
    assert time.monotonic() - start < 2.0, "the disconnect reached the prefill instance only at its end"
    time.sleep(max(0.0, start + 2.3 - time.monotonic()))     # past when the prefill would have answered
    assert not any(d.bodies for d in cluster.decode)


def test_client_leaving_during_decode_cancels_it(cluster):
    for fake in cluster.decode:
        fake.delay = 2.0
    start = time.monotonic()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(cluster.proxy + CH, json={"model": "tiny", "messages": MESSAGES},
                   timeout=httpx.Timeout(5, read=0.3))
    assert cluster.one(cluster.decode).saw_disconnect.wait(3), "the decode instance did not see the client go"
    assert time.monotonic() - start < 2.0
    cluster.one(cluster.prefill)
    for fake in cluster.decode:          # and the proxy goes on serving
        fake.delay = 0.0
    out = cluster.client().chat.completions.create(model="tiny", messages=MESSAGES)
    assert out.choices[0].message.content.startswith("decoded by d")


# ---- /health, /v1/models -----------------------------------------------------------------------

def test_health(cluster):
    r = httpx.get(cluster.proxy + "/health", timeout=10)
    assert r.status_code == 200, r.text
    dead = dead_url()
    with running(build_proxy_app(ProxyConfig([f.base for f in cluster.prefill], [cluster.decode[0].base, dead]))) as proxy:
        message = error_of(httpx.get(proxy + "/health", timeout=10), 503)
        assert f"decode {dead} (unreachable" in message, message
        assert cluster.decode[0].base not in message and cluster.prefill[0].base not in message


def test_models_come_from_the_first_decode_instance(cluster):
    models = cluster.client().models.list()
    assert [m.id for m in models.data] == ["model-of-d0"]


# ---- configuration -----------------------------------------------------------------------------

@pytest.mark.parametrize("url", ["http://10.0.0.1:8000", "http://10.0.0.1:8000/", "http://10.0.0.1:8000/v1",
                                 "http://10.0.0.1:8000/v1/", " http://10.0.0.1:8000/v1 "])
def test_urls_are_normalised(url):
    assert normalize_url(url) == "http://10.0.0.1:8000"


def test_config():
    config = ProxyConfig(["https://a:1/v1/", "http://b:2"], "http://c:3/", timeout=5)
    assert config.prefill_urls == ("https://a:1", "http://b:2") and config.decode_urls == ("http://c:3",)
    for prefill, decode in [([], ["http://c:3"]), (["http://a:1"], []), (["localhost:8000"], ["http://c:3"]),
                            (["http://a:1"], ["c:3"]), (["http://a:1/other"], ["http://c:3"]),
                            (["http://a:x"], ["http://c:3"]), (["ftp://a:1"], ["http://c:3"])]:
        with pytest.raises(ValueError):
            ProxyConfig(prefill, decode)
    with pytest.raises(ValueError, match="no prefill instances"):
        ProxyConfig([], ["http://c:3"])
    with pytest.raises(ValueError, match="timeout"):
        ProxyConfig(["http://a:1"], ["http://c:3"], timeout=0)


def test_run_proxy(cluster):
    """run_proxy in a subprocess: it names what it fronts, proxies, and SIGTERM ends it with 0."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = ("import logging, sys; logging.basicConfig(level=logging.INFO); "
            "from twostep.entrypoints.openai.disagg_proxy import run_proxy; "
            f"sys.exit(run_proxy([{cluster.prefill[1].base + '/v1/'!r}], [{cluster.decode[1].base!r}], "
            f"'127.0.0.1', {port}, log_level='warning'))")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        base, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 30
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "the proxy did not start"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            time.sleep(0.1)
        r = httpx.post(base + C, json={"model": "tiny", "prompt": "a", "max_tokens": 3}, timeout=10)
        assert r.json()["choices"][0]["text"] == "decoded by d1"
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out.decode()
    assert f"prefill on {cluster.prefill[1].base}, decode on {cluster.decode[1].base}" in out.decode()
