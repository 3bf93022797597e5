"""`twostep bench serve`: metrics on fake timestamps, the arrival schedule, SSE parsing, and the
command end to end against a real `twostep serve` process."""
from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from twostep.bench import serve, workloads
from twostep.bench.serve import DONE, RequestTiming, SSEParser, poisson_gaps, summarize
from twostep.cli import main

ROOT = Path(__file__).resolve().parents[2]


# ---- metrics -----------------------------------------------------------------------------------

def test_metrics_from_known_timestamps():
    # sent at 10.0; content at 10.1, 10.3, 10.6; stream ends 10.7; usage says 4 tokens
    a = RequestTiming(start=10.0, chunk_times=[10.1, 10.3, 10.6], output_tokens=4, end=10.7, ok=True)
    # sent at 20.0; one chunk at 20.5; ends 21.0; 1 token: no TPOT, no ITL; 3 of 7 prompt tokens cached
    b = RequestTiming(start=20.0, chunk_times=[20.5], output_tokens=1, end=21.0, ok=True, cached_tokens=3)
    # a failure: counted, but in no latency or token figure
    c = RequestTiming(start=30.0, chunk_times=[30.01], output_tokens=50, end=99.0, ok=False, error="x")
    assert a.ttft == pytest.approx(0.1) and a.e2el == pytest.approx(0.7)
    assert a.itls == pytest.approx([0.2, 0.3])
    assert a.tpot == pytest.approx((0.7 - 0.1) / 3)
    assert b.tpot is None and b.itls == []

    r = summarize([a, b, c], duration=2.0, input_tokens=[5, 7, 1000])
    assert (r["completed"], r["failed"]) == (2, 1)
    assert r["total_input_tokens"] == 12 and r["total_output_tokens"] == 5
    assert r["request_throughput"] == pytest.approx(1.0)
    assert r["output_throughput"] == pytest.approx(2.5)
    assert r["total_token_throughput"] == pytest.approx(8.5)
    assert r["prefix_cache_hit_rate"] == pytest.approx(3 / 12)
    # TTFT over [100, 500] ms; linear-interpolated percentiles like numpy
    assert r["mean_ttft_ms"] == pytest.approx(300.0)
    assert r["median_ttft_ms"] == pytest.approx(300.0)
    assert r["p99_ttft_ms"] == pytest.approx(100 + 0.99 * 400)
    assert r["mean_tpot_ms"] == r["median_tpot_ms"] == r["p99_tpot_ms"] == pytest.approx(200.0)
    # ITLs pooled over requests: [200, 300]
    assert r["mean_itl_ms"] == pytest.approx(250.0)
    assert r["p99_itl_ms"] == pytest.approx(200 + 0.99 * 100)
    # E2EL over [700, 1000] ms
    assert r["mean_e2el_ms"] == pytest.approx(850.0)
    assert r["p99_e2el_ms"] == pytest.approx(700 + 0.99 * 300)
    keys = {"completed", "failed", "duration", "total_input_tokens", "total_output_tokens",
            "request_throughput", "output_throughput", "total_token_throughput", "prefix_cache_hit_rate"}
    keys |= {f"{s}_{m}_ms" for s in ("mean", "median", "p99") for m in ("ttft", "tpot", "itl", "e2el")}
    assert set(r) == keys
    table = serve.format_table(r, math.inf, 4)
    for label in ("Successful requests:", "Benchmark duration (s):", "Total input tokens:",
                  "Total generated tokens:", "Request throughput (req/s):",
                  "Output token throughput (tok/s):", "Total token throughput (tok/s):",
                  "Mean TTFT (ms):", "Median TPOT (ms):", "P99 ITL (ms):", "P99 E2EL (ms):"):
        assert label in table

    none = summarize([c], duration=1.0, input_tokens=[3])
    assert none["completed"] == 0 and none["failed"] == 1 and none["mean_ttft_ms"] == 0.0


# ---- arrivals ----------------------------------------------------------------------------------

def test_poisson_arrivals_are_seeded_with_the_requested_mean():
    a = poisson_gaps(4001, rate=20.0, seed=1)
    assert a == poisson_gaps(4001, rate=20.0, seed=1)
    assert a != poisson_gaps(4001, rate=20.0, seed=2)
    assert a[0] == 0.0 and all(g > 0 for g in a[1:])
    assert sum(a[1:]) / 4000 == pytest.approx(1 / 20.0, rel=0.1)
    assert poisson_gaps(5, math.inf) == [0.0] * 5
    with pytest.raises(ValueError):
        poisson_gaps(3, 0.0)


# ---- SSE -----------------------------------------------------------------------------------------

def test_base_url_may_end_in_v1():
    assert serve.server_root("http://h:8000/v1") == serve.server_root("http://h:8000/v1/") == "http://h:8000"
    assert serve.server_root("http://h:8000/") == "http://h:8000"


def test_sse_parsing_of_a_split_byte_stream():
    events = [
        {"choices": [{"index": 0, "text": "Hel", "finish_reason": None}]},
        {"choices": [{"index": 0, "text": "lo 🙂", "finish_reason": None}]},
        {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]},
        {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}},
    ]
    raw = b": keep-alive comment\r\n\r\n"
    raw += b"".join(b"data: " + json.dumps(e, ensure_ascii=False).encode() + b"\n\n" for e in events)
    raw += b"\n\ndata: [DONE]\n\n"
    for size in (1, 3, 7, len(raw)):   # any split of the bytes, even inside a UTF-8 character
        parser = SSEParser()
        got = []
        for i in range(0, len(raw), size):
            got += parser.feed(raw[i:i + size])
        got += parser.close()
        assert got == [*events, DONE]

    # folding the events into a timing: content chunks, usage, completion
    t = RequestTiming(start=0.0)
    ends = [serve._apply_event(t, e, float(i + 1)) for i, e in enumerate([*events, DONE])]
    assert ends == [False, False, True, False, True]
    assert t.chunk_times == [1.0, 2.0] and t.output_tokens == 3 and t.prompt_tokens == 5
    # chat deltas: the role-only first chunk is not content
    c = RequestTiming(start=0.0)
    serve._apply_event(c, {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}, 1.0)
    serve._apply_event(c, {"choices": [{"index": 0, "delta": {"content": "Hi"}}]}, 2.0)
    assert c.chunk_times == [2.0]
    # an event without its blank line at the end of the stream; an error event raises
    p = SSEParser()
    assert p.feed(b'data: {"a": 1}') == [] and p.close() == [{"a": 1}]
    with pytest.raises(ValueError):
        serve._apply_event(RequestTiming(start=0.0), {"error": {"message": "boom"}}, 1.0)


# ---- end to end --------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server_url(tiny_model_dir, tmp_path_factory):
    folder = tiny_model_dir("qwen2")
    port = _free_port()
    log_path = tmp_path_factory.mktemp("bench-serve") / "server.log"
    cmd = [sys.executable, "-m", "twostep.cli", "serve", "--model", str(folder),
           "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
           "--kv-cache-memory", "16MiB", "--served-model-name", "tiny"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                pytest.fail(f"server exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
            try:
                if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"server not healthy after 60 s:\n{log_path.read_text()[-4000:]}")
            time.sleep(0.2)
        yield url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def _check_latencies(r: dict) -> None:
    for m in ("ttft", "tpot", "itl", "e2el"):
        assert r[f"mean_{m}_ms"] > 0, m
        assert 0 < r[f"median_{m}_ms"] <= r[f"p99_{m}_ms"] + 1e-9, m
    assert r["median_ttft_ms"] <= r["p99_e2el_ms"]
    assert r["duration"] > 0 and r["output_throughput"] > 0


def test_bench_serve_end_to_end(server_url, capsys, tmp_path):
    saved = tmp_path / "result.json"
    assert main(["bench", "serve", "--base-url", server_url, "--dataset", "random", "--num-prompts", "12",
                 "--random-input-range", "4:20", "--random-output-range", "2:8",
                 "--max-concurrency", "4", "--json", "--save-json", str(saved)]) == 0
    captured = capsys.readouterr()
    r = json.loads(captured.out.strip().splitlines()[-1])
    assert "requests" in captured.err and "12/12" in captured.err     # the progress bar
    expected = workloads.uniform(12, (4, 20), (2, 8), serve.DEFAULT_VOCAB, 0)
    assert r["completed"] == 12 and r["failed"] == 0, r["errors"]
    assert r["model"] == "tiny"   # found through /v1/models
    assert r["total_output_tokens"] == sum(x.output_len for x in expected)
    assert r["total_input_tokens"] == sum(len(x.prompt_token_ids) for x in expected)
    _check_latencies(r)
    assert json.loads(saved.read_text()) == r


def test_bench_serve_chat_poisson_and_failures(server_url, capsys):
    # chat endpoint, Poisson arrivals, the vLLM table; a base URL ending in /v1 as OpenAI clients write it
    assert main(["bench", "serve", "--base-url", server_url + "/v1/", "--endpoint", "/v1/chat/completions",
                 "--dataset", "fixed", "--num-prompts", "4", "--input-len", "6", "--output-len", "4",
                 "--request-rate", "20"]) == 0
    out = capsys.readouterr().out
    assert "Serving Benchmark Result" in out
    assert "Successful requests:                     4" in out
    assert "Total generated tokens:                  16" in out
    # a wrong model name: every request fails (HTTP 404), the run still completes
    assert main(["bench", "serve", "--base-url", server_url, "--model", "nope", "--num-prompts", "3",
                 "--input-len", "4", "--output-len", "2", "--json"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["completed"] == 0 and r["failed"] == 3 and r["errors"][0].startswith("ValueError: HTTP 4")


def test_shared_prefix_conversations_grow_turn_by_turn_and_wait_for_their_last_turn():
    from twostep.bench.workloads import shared_prefix

    reqs = shared_prefix(num_conversations=3, turns=2, system_len=10, turn_len=4, output_len=5, vocab_size=100)
    assert len(reqs) == 6
    first, second = reqs[:3], reqs[3:]
    assert all(r.after is None and len(r.prompt_token_ids) == 14 for r in first)
    for c, r in enumerate(second):
        assert r.after == c and len(r.prompt_token_ids) == 14 + 5 + 4
        assert r.prompt_token_ids[:14] == first[c].prompt_token_ids          # its own history first
    assert len({tuple(r.prompt_token_ids[:10]) for r in reqs}) == 1            # one system prompt
