"""A bounded soak: 100 concurrent streams against a server whose small KV cache forces preemption,
a third of the clients leaving at random points. The server runs in this process (uvicorn on a
loopback port, real HTTP clients) so that its block pool can be checked at the end."""
from __future__ import annotations

import asyncio
import random
import threading
import time

import httpx
import pytest

from conftest import free_port, parse_sse

CLIENTS = 100


@pytest.fixture(scope="module")
def live(tiny_model_dir):
    import uvicorn

    from twostep.engine.llm_engine import LLMEngine
    from twostep.config import EngineConfig
    from twostep.entrypoints.openai.server import ServerConfig, build_app

    # 512 B per token: 96 blocks of 16 hold 1,536 tokens; 100 requests of up to ~70 need ~7,000
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir("qwen2")), dtype="float32",
                                    kv_cache_memory=96 * 16 * 512, max_num_seqs=48,
                                    max_num_batched_tokens=256))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(engine, ServerConfig("tiny")), host="127.0.0.1",
                                           port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.1)
    yield base, engine
    server.should_exit = True
    thread.join(30)


def greedy(base: str) -> str:
    r = httpx.post(base + "/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": "Once upon a time", "max_tokens": 24, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


async def one_client(client: httpx.AsyncClient, base: str, i: int, rng: random.Random) -> str:
    """'done' for a complete stream, 'left' for a client that hung up, 'error: ...' otherwise."""
    body = {"model": "tiny", "prompt": f"story {i}: " + "once upon a time " * rng.randint(1, 6),
            "max_tokens": rng.randint(8, 40), "temperature": rng.choice([0, 0.8]), "seed": i,
            "ignore_eos": True, "stream": True}
    leave_after = rng.randint(1, body["max_tokens"] // 2) if i % 3 == 0 else None   # mid-stream
    async with client.stream("POST", base + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return f"error: {r.status_code} {(await r.aread())[:200]!r}"
        lines = []
        async for line in r.aiter_lines():
            lines.append(line)
            if leave_after is not None and sum(x.startswith("data: ") for x in lines) >= leave_after:
                return "left"
    chunks = parse_sse(lines)          # ends with [DONE], nothing after it
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    return "done" if finish == ["length"] else f"error: finish {finish}"


async def soak(base: str) -> list[str]:
    rng = random.Random(0)
    limits = httpx.Limits(max_connections=CLIENTS + 10)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        return await asyncio.gather(*(one_client(client, base, i, rng) for i in range(CLIENTS)))


@pytest.mark.slow
def test_a_hundred_streams_with_preemption_and_clients_leaving(live):
    base, engine = live
    before = greedy(base)
    results = asyncio.run(soak(base))
    assert not [r for r in results if r.startswith("error")], [r for r in results if r.startswith("error")][:5]
    assert results.count("left") == len(range(0, CLIENTS, 3))
    assert engine.get_stats()["num_preemptions"] > 0, "the cache was meant to force preemption"
    deadline = time.monotonic() + 30
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not engine.has_unfinished_requests()
    kv = engine.scheduler.kv
    kv.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks
    assert greedy(base) == before
