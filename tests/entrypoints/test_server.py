"""`twostep serve` end to end: a real server process on a free loopback port, driven with the
official openai client and with httpx. Covers the OpenAI/vLLM request and response shapes,
streaming, logprobs and echo, error handling, disconnects, the waiting-queue limit, per-request
deadlines, /metrics and graceful shutdown."""
from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from conftest import (MODEL, ROOT, Server, make_tiny_model, metric, parse_sse, random_prompts, scrape, serving,
                      stream_post, stream_text, tokenize)
from twostep import LLM, SamplingParams

MAX_MODEL_LEN = 64          # of the main server: a too-long prompt is cheap to send
LONG_MAX_TOKENS = 16000     # takes the tiny model well over 20 s on two CPU cores

CJK = "你好，世界！こんにちは 🙂🚀"
EMOJI = "Once upon a time 🙂 there was a little girl"
MIXED = "café naïve 🙂 The quick brown fox"
ASCII = "What is the capital of France?"
CHAT = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "你好 🙂 capital of France?"}]

HISTOGRAMS = ["time_to_first_token_seconds", "inter_token_latency_seconds",
              "request_time_per_output_token_seconds", "e2e_request_latency_seconds",
              "request_queue_time_seconds", "request_prefill_time_seconds",
              "request_decode_time_seconds"]
GAUGES = ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"]
COUNTERS = ["prompt_tokens", "generation_tokens", "prefix_cache_queries", "prefix_cache_hits",
            "num_preemptions", "request_success"]


# ---- the server process --------------------------------------------------------------------

@pytest.fixture(scope="module")
def log_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("server-logs")


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("qwen2")


@pytest.fixture(scope="module")
def long_model_dir(tmp_path_factory):
    """The same tiny model with a 16k context, for requests that run for many seconds."""
    return make_tiny_model(tmp_path_factory.mktemp("qwen2-long"), "qwen2", max_position_embeddings=16384)


@pytest.fixture(scope="module")
def server(model_dir, log_dir):
    yield from serving(model_dir, log_dir, "--max-model-len", str(MAX_MODEL_LEN))


@pytest.fixture(scope="module")
def limited_server(long_model_dir, log_dir):
    yield from serving(long_model_dir, log_dir, "--max-queued-requests", "2", "--max-num-seqs", "1")


@pytest.fixture(scope="module")
def timeout_server(long_model_dir, log_dir):
    yield from serving(long_model_dir, log_dir, "--request-timeout", "0.5")


@pytest.fixture(scope="module")
def offline(model_dir):
    return LLM(str(model_dir), dtype="float32", kv_cache_memory="8MiB", max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def client(server):
    import openai

    with openai.OpenAI(base_url=server.url("/v1"), api_key="x", max_retries=0, timeout=60.0) as c:
        yield c


# ---- helpers --------------------------------------------------------------------------------

def finish_reasons(chunks: list[dict]) -> dict[int, str]:
    out: dict[int, str] = {}
    for chunk in chunks:
        for ch in chunk["choices"]:
            if ch.get("finish_reason"):
                assert ch["index"] not in out, f"two finish reasons for choice {ch['index']}"
                out[ch["index"]] = ch["finish_reason"]
    return out


def final_usage(chunks: list[dict]) -> dict:
    last = chunks[-1]
    assert last.get("usage") and last["choices"] == [], f"no final usage chunk: {last}"
    assert all(c.get("usage") is None for c in chunks[:-1]), "usage before the last chunk"
    return last["usage"]


def assert_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, f"expected {status}, got {r.status_code}: {r.text[:500]}"
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert {"message", "type", "param", "code"} <= set(err), err
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and err["type"], err
    return err


def first_clean_window(text: str, width: int = 3) -> str:
    """A substring of `text` after its first character without replacement characters."""
    for i in range(1, len(text) - width):
        window = text[i:i + width]
        if "\ufffd" not in window:
            return window
    pytest.fail(f"no usable stop string in {text!r}")


def close(a: float, b: float, tol: float = 1e-4) -> bool:
    return abs(a - b) < tol


def wait_idle(server, timeout: float) -> dict:
    """Poll /metrics until nothing runs or waits and no KV block is held."""
    deadline = time.monotonic() + timeout
    while True:
        fams = scrape(server)
        state = {g: metric(fams, "twostep:" + g) for g in GAUGES}
        if all(v == 0 for v in state.values()) or time.monotonic() > deadline:
            return state
        time.sleep(0.1)


# ---- 1. the openai client: completions and chat ---------------------------------------------

def test_health_models_tokenize_detokenize(server, client, offline):
    assert httpx.get(server.url("/health"), timeout=10).status_code == 200
    models = client.models.list().data
    assert MODEL in [m.id for m in models]
    for text in (CJK, EMOJI, ASCII):
        body = tokenize(server, text)
        assert body["tokens"] == offline.tokenizer.encode(text)
        assert body["count"] == len(body["tokens"])
        assert body["max_model_len"] == MAX_MODEL_LEN
        r = httpx.post(server.url("/detokenize"), json={"model": MODEL, "tokens": body["tokens"]}, timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["prompt"] == text


@pytest.mark.parametrize("prompt", [CJK, EMOJI, MIXED], ids=["cjk", "emoji", "mixed"])
def test_greedy_completion_matches_offline(client, offline, prompt):
    resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
    ref = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    assert resp.object == "text_completion" and resp.model == MODEL
    assert len(resp.choices) == 1 and resp.choices[0].index == 0
    assert resp.choices[0].text == ref.outputs[0].text
    assert resp.choices[0].finish_reason == ref.outputs[0].finish_reason
    assert resp.usage.completion_tokens == len(ref.outputs[0].token_ids)
    assert resp.usage.prompt_tokens == len(ref.prompt_token_ids)


def test_prompt_forms_list_and_token_ids(client, offline):
    prompts = [CJK, ASCII]
    refs = offline.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                            use_tqdm=False)
    resp = client.completions.create(model=MODEL, prompt=prompts, max_tokens=10, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert sorted(c.index for c in resp.choices) == [0, 1]
    by_index = {c.index: c.text for c in resp.choices}
    assert [by_index[0], by_index[1]] == [r.outputs[0].text for r in refs]
    assert resp.usage.completion_tokens == 20
    assert resp.usage.prompt_tokens == sum(len(r.prompt_token_ids) for r in refs)
    ids = refs[0].prompt_token_ids
    resp = client.completions.create(model=MODEL, prompt=ids, max_tokens=10, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert resp.choices[0].text == refs[0].outputs[0].text
    assert resp.usage.prompt_tokens == len(ids)


def test_greedy_chat_matches_offline(client, offline):
    resp = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=20, temperature=0)
    ref = offline.chat(CHAT, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0]
    assert resp.object == "chat.completion"
    msg = resp.choices[0].message
    assert msg.role == "assistant" and msg.content == ref.outputs[0].text
    assert resp.choices[0].finish_reason == ref.outputs[0].finish_reason
    assert resp.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert resp.usage.completion_tokens == len(ref.outputs[0].token_ids)


@pytest.mark.parametrize("prompt", [CJK, MIXED], ids=["cjk", "mixed"])
def test_seeded_completion_stream_joins_to_full_text(client, prompt):
    kw = dict(model=MODEL, prompt=prompt, max_tokens=24, temperature=1.0, seed=1234,
              extra_body={"ignore_eos": True})
    full = client.completions.create(**kw)
    pieces, finish, usage = [], None, None
    for chunk in client.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            usage = chunk.usage
            assert chunk.choices == []
        for ch in chunk.choices:
            pieces.append(ch.text)
            finish = ch.finish_reason or finish
    assert "".join(pieces) == full.choices[0].text
    assert finish == full.choices[0].finish_reason == "length"
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens == 24
    assert usage.prompt_tokens == full.usage.prompt_tokens
    assert usage.total_tokens == usage.prompt_tokens + 24
    other = client.completions.create(**{**kw, "seed": 99})
    assert other.choices[0].text != full.choices[0].text


def test_seeded_chat_stream_joins_to_full_text(client):
    messages = [{"role": "user", "content": CJK}]
    kw = dict(model=MODEL, messages=messages, max_tokens=24, temperature=1.0, seed=42,
              extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kw)
    pieces, roles, finish, usage = [], [], None, None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        assert chunk.object == "chat.completion.chunk"
        if chunk.usage is not None:
            usage = chunk.usage
            assert chunk.choices == []
        for ch in chunk.choices:
            if ch.delta.role:
                roles.append(ch.delta.role)
            pieces.append(ch.delta.content or "")
            finish = ch.finish_reason or finish
    assert roles and roles[0] == "assistant"
    assert "".join(pieces) == full.choices[0].message.content
    assert finish == full.choices[0].finish_reason == "length"
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens == 24


def test_stop_strings_cut_the_output(client, offline):
    ref = offline.generate([CJK], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0].text
    stop = first_clean_window(ref)
    cut = ref[:ref.index(stop)]
    kw = dict(model=MODEL, prompt=CJK, max_tokens=30, temperature=0, extra_body={"ignore_eos": True})
    resp = client.completions.create(stop=[stop], **kw)
    assert resp.choices[0].text == cut
    assert resp.choices[0].finish_reason == "stop"
    # a string given on its own, and a stop that never appears next to one that does
    resp = client.completions.create(stop=stop, **kw)
    assert resp.choices[0].text == cut
    resp = client.completions.create(stop=["\u2603never\u2603", stop], **kw)
    assert resp.choices[0].text == cut
    # streamed: the deltas never show the stop string or anything after it
    pieces, finish = [], None
    for chunk in client.completions.create(stop=[stop], stream=True, **kw):
        for ch in chunk.choices:
            pieces.append(ch.text)
            finish = ch.finish_reason or finish
    assert "".join(pieces) == cut and finish == "stop"


def test_stop_strings_in_chat(client, offline):
    ref = offline.chat(CHAT, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0].text
    stop = first_clean_window(ref)
    resp = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=20, temperature=0,
                                          stop=[stop], extra_body={"ignore_eos": True})
    assert resp.choices[0].message.content == ref[:ref.index(stop)]
    assert resp.choices[0].finish_reason == "stop"


def test_n_choices(client, server):
    kw = dict(model=MODEL, prompt=EMOJI, max_tokens=8, temperature=1.0, seed=7, n=3,
              extra_body={"ignore_eos": True})
    resp = client.completions.create(**kw)
    assert sorted(c.index for c in resp.choices) == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in resp.choices)
    assert len({c.text for c in resp.choices}) > 1, "three samples were identical"
    assert resp.usage.completion_tokens == 24
    # streamed with the same seed: each index carries the same text as the non-streamed choice
    chunks = stream_post(server.url("/v1/completions"), {
        "model": MODEL, "prompt": EMOJI, "max_tokens": 8, "temperature": 1.0, "seed": 7, "n": 3,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}})
    texts = stream_text(chunks, chat=False)
    assert texts == {c.index: c.text for c in resp.choices}
    assert finish_reasons(chunks) == {0: "length", 1: "length", 2: "length"}
    assert final_usage(chunks)["completion_tokens"] == 24

    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=1.0,
                                          seed=3, n=3, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in chat.choices) == [0, 1, 2]
    assert all(c.message.role == "assistant" for c in chat.choices)
    assert chat.usage.completion_tokens == 18


def test_completion_logprobs_match_offline(client, offline):
    resp = client.completions.create(model=MODEL, prompt=MIXED, max_tokens=8, temperature=0, logprobs=3,
                                     extra_body={"ignore_eos": True})
    ref = offline.generate([MIXED], SamplingParams(temperature=0, max_tokens=8, logprobs=3, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0]
    lp = resp.choices[0].logprobs
    assert lp is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    assert lp.text_offset == sorted(lp.text_offset)
    for i, tok in enumerate(ref.token_ids):
        assert close(lp.token_logprobs[i], ref.logprobs[i][tok].logprob)
        top = lp.top_logprobs[i]
        assert 1 <= len(top) <= 3
        ref_values = [v.logprob for v in ref.logprobs[i].values()]
        assert all(any(close(v, r) for r in ref_values) for v in top.values()), (top, ref_values)
        # keyed by decoded text, so tokens that decode alike (partial UTF-8) share one key
        names = [offline.tokenizer.decode([t]) for t in ref.logprobs[i]]
        assert set(top) <= set(names), (top, names)
        chosen = ref.logprobs[i][tok].decoded_token
        if names.count(chosen) == 1:
            assert close(top[chosen], lp.token_logprobs[i])


def test_chat_logprobs_match_offline(client, offline):
    resp = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0,
                                          logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    ref = offline.chat(CHAT, SamplingParams(temperature=0, max_tokens=8, logprobs=2, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    content = resp.choices[0].logprobs.content
    assert len(content) == 8
    for i, (entry, tok) in enumerate(zip(content, ref.token_ids)):
        assert close(entry.logprob, ref.logprobs[i][tok].logprob)
        assert len(entry.top_logprobs) == 2
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert close(values[0], entry.logprob)
        assert isinstance(entry.token, str)
    # without logprobs there are none
    plain = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None


def test_openai_and_vllm_sampling_fields(client, offline):
    first = offline.generate([EMOJI], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
    tok = first.outputs[0].token_ids[0]
    extra = {"top_k": 5, "min_p": 0.01, "repetition_penalty": 1.1, "ignore_eos": True, "min_tokens": 2}
    resp = client.completions.create(model=MODEL, prompt=EMOJI, max_tokens=6, temperature=0.9, top_p=0.9,
                                     presence_penalty=0.5, frequency_penalty=0.5, user="tester", seed=5,
                                     extra_body=extra)
    assert resp.usage.completion_tokens == 6 and resp.choices[0].finish_reason == "length"
    # stop_token_ids ends on the token; min_tokens holds it off
    resp = client.completions.create(model=MODEL, prompt=EMOJI, max_tokens=10, temperature=0,
                                     extra_body={"stop_token_ids": [tok]})
    assert resp.choices[0].finish_reason == "stop" and resp.usage.completion_tokens == 1
    resp = client.completions.create(model=MODEL, prompt=EMOJI, max_tokens=10, temperature=0,
                                     extra_body={"stop_token_ids": [tok], "min_tokens": 3})
    assert resp.usage.completion_tokens >= 3
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=5, temperature=0.5,
                                          top_p=0.8, presence_penalty=0.1, user="tester",
                                          extra_body={"ignore_eos": True, "top_k": 3})
    assert chat.usage.completion_tokens == 5 and chat.choices[0].finish_reason == "length"


def test_usage_counts_are_exact(client, server):
    for prompt, max_tokens in [(CJK, 1), (EMOJI, 7), (ASCII, 19)]:
        resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0.7,
                                         extra_body={"ignore_eos": True})
        u = resp.usage
        assert u.prompt_tokens == tokenize(server, prompt)["count"]
        assert u.completion_tokens == max_tokens
        assert u.total_tokens == u.prompt_tokens + u.completion_tokens
        assert u.prompt_tokens_details is not None and isinstance(u.prompt_tokens_details.cached_tokens, int)
    # a prompt of more than two KV blocks, sent twice: the second finds its prefix cached
    prompt = "Usage test, prefix caching: " + "Lily loved to play outside. " * 4
    n_prompt = tokenize(server, prompt)["count"]
    assert 33 <= n_prompt <= MAX_MODEL_LEN - 4, n_prompt
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens == second.usage.prompt_tokens == n_prompt
    assert 0 < second.usage.prompt_tokens_details.cached_tokens < n_prompt
    assert second.choices[0].text == first.choices[0].text


# ---- 2. echo with prompt logprobs (lm-evaluation-harness loglikelihood) ----------------------

@pytest.mark.parametrize("max_tokens", [0, 1])
@pytest.mark.parametrize("prompt", [ASCII, "The capital of France is Paris. 你好 🚀"], ids=["ascii", "cjk"])
def test_echo_prompt_logprobs_match_offline(server, offline, prompt, max_tokens):
    r = httpx.post(server.url("/v1/completions"), json={
        "model": MODEL, "prompt": prompt, "echo": True, "logprobs": 2, "max_tokens": max_tokens,
        "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    ch = body["choices"][0]
    ref = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=1, logprobs=2, prompt_logprobs=2),
                           use_tqdm=False)[0]
    ids = ref.prompt_token_ids
    n = len(ids)
    lp = ch["logprobs"]
    total = n + max_tokens
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == total
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for i in range(1, n):
        ref_pos = ref.prompt_logprobs[i]
        assert close(lp["token_logprobs"][i], ref_pos[ids[i]].logprob), i
        top = lp["top_logprobs"][i]
        assert 1 <= len(top) <= 3
        ref_values = [v.logprob for v in ref_pos.values()]
        assert all(any(close(v, rv) for rv in ref_values) for v in top.values()), (i, top, ref_values)
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    if prompt.isascii():   # every token decodes on its own: the pieces spell the prompt
        assert "".join(lp["tokens"][:n]) == prompt
        assert lp["text_offset"][:n] == [len("".join(lp["tokens"][:i])) for i in range(n)]
    if max_tokens == 0:
        assert ch["text"] == prompt
    else:
        gen = ref.outputs[0]
        assert ch["text"] == prompt + gen.text
        assert close(lp["token_logprobs"][n], gen.logprobs[0][gen.token_ids[0]].logprob)
        assert lp["text_offset"][n] == len(prompt), (
            f"the generated token's text_offset must be where it starts in the text: "
            f"{list(zip(lp['tokens'], lp['text_offset']))}")
    assert body["usage"]["prompt_tokens"] == n
    assert body["usage"]["completion_tokens"] == max_tokens


# ---- 3. bad requests --------------------------------------------------------------------------

C, CH = "/v1/completions", "/v1/chat/completions"
OK_CHAT = [{"role": "user", "content": "hi"}]
BAD_REQUESTS = [
    ("max_tokens as a string", C, {"model": MODEL, "prompt": "hi", "max_tokens": "ten"}, 400),
    ("negative max_tokens", C, {"model": MODEL, "prompt": "hi", "max_tokens": -1}, 400),
    ("max_tokens 0 without echo", C, {"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400),
    ("negative temperature", C, {"model": MODEL, "prompt": "hi", "temperature": -1}, 400),
    ("top_p above 1", C, {"model": MODEL, "prompt": "hi", "top_p": 2.0}, 400),
    ("n 0", C, {"model": MODEL, "prompt": "hi", "n": 0}, 400),
    ("beam search", C, {"model": MODEL, "prompt": "hi", "use_beam_search": True}, 400),
    ("legacy functions", CH, {"model": MODEL, "messages": OK_CHAT, "functions": [{"name": "f"}]}, 400),
    ("audio output", CH, {"model": MODEL, "messages": OK_CHAT, "modalities": ["text", "audio"]}, 400),
    ("priority scheduling", C, {"model": MODEL, "prompt": "hi", "priority": 1}, 400),
    ("prompt_logprobs streamed", C, {"model": MODEL, "prompt": "hi", "prompt_logprobs": 1, "stream": True}, 400),
    ("truncate_prompt_tokens 0", C, {"model": MODEL, "prompt": "hi", "truncate_prompt_tokens": 0}, 400),
    ("continue_final_message with a generation prompt", CH,
     {"model": MODEL, "messages": OK_CHAT + [{"role": "assistant", "content": "Hel"}],
      "continue_final_message": True}, 400),
    ("prompt over max_model_len", C, {"model": MODEL, "prompt": "Lily loved to play outside. " * 20}, 400),
    ("token ids over max_model_len", C, {"model": MODEL, "prompt": [5] * (MAX_MODEL_LEN + 10)}, 400),
    ("token id out of vocabulary", C, {"model": MODEL, "prompt": [5, 10**6]}, 400),
    ("empty prompt", C, {"model": MODEL, "prompt": ""}, 400),
    ("prompt of the wrong type", C, {"model": MODEL, "prompt": {"a": 1}}, 400),
    ("suffix", C, {"model": MODEL, "prompt": "hi", "suffix": "bye"}, 400),
    ("empty messages", CH, {"model": MODEL, "messages": []}, 400),
    ("messages not a list", CH, {"model": MODEL, "messages": "hi"}, 400),
    ("chat max_tokens as a string", CH, {"model": MODEL, "messages": OK_CHAT, "max_tokens": "ten"}, 400),
    ("chat negative temperature", CH, {"model": MODEL, "messages": OK_CHAT, "temperature": -1}, 400),
    ("body not an object", C, [1, 2, 3], 400),
    ("unknown model", C, {"model": "no-such-model", "prompt": "hi"}, 404),
    ("unknown model in chat", CH, {"model": "no-such-model", "messages": OK_CHAT}, 404),
]


def test_bad_requests_get_openai_errors_while_a_good_stream_completes(server):
    stop = threading.Event()
    results: list = []

    def good_streams():
        body = {"model": MODEL, "prompt": CJK, "max_tokens": 40, "temperature": 1.0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        try:
            while True:
                chunks = stream_post(server.url(C), body)
                results.append((final_usage(chunks)["completion_tokens"], finish_reasons(chunks)))
                if stop.is_set():
                    return
        except BaseException as e:  # reported by the main thread
            results.append(e)

    worker = threading.Thread(target=good_streams, daemon=True)
    worker.start()
    failures = []
    try:
        with httpx.Client(timeout=30) as c:
            for name, path, body, status in BAD_REQUESTS:
                try:
                    err = assert_error(c.post(server.url(path), json=body), status)
                    if "max_model_len" in name:
                        assert str(MAX_MODEL_LEN) in err["message"], f"limit not in message: {err}"
                except AssertionError as e:
                    failures.append(f"{name}: {e}")
            for name, raw in [("malformed JSON", b'{"model": "tiny", "prompt": '),
                              ("not JSON at all", b"prompt=hi")]:
                for path in (C, CH):
                    try:
                        assert_error(c.post(server.url(path), content=raw,
                                            headers={"content-type": "application/json"}), 400)
                    except AssertionError as e:
                        failures.append(f"{name} to {path}: {e}")
    finally:
        stop.set()
        worker.join(60)
    assert not worker.is_alive(), "the good stream hung"
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, f"the concurrent good request failed: {errors[0]!r}"
    assert results and all(r == (40, {0: "length"}) for r in results), results
    assert not failures, "\n".join(failures)
    assert httpx.get(server.url("/health"), timeout=10).status_code == 200


# ---- 7. /metrics --------------------------------------------------------------------------------

def test_metrics_parse_and_agree_with_requests(server, client):
    fams = scrape(server)
    for name in HISTOGRAMS:
        fam = fams.get("twostep:" + name)
        assert fam is not None and fam.type == "histogram", name
        buckets = [s for s in fam.samples if s.name.endswith("_bucket")]
        assert any(s.labels.get("le") == "+Inf" for s in buckets), name
    for name in GAUGES:
        assert fams.get("twostep:" + name) is not None and fams["twostep:" + name].type == "gauge", name
    for name in COUNTERS:
        assert fams.get("twostep:" + name) is not None and fams["twostep:" + name].type == "counter", name

    before = fams
    # short prompts (no full 16-token KV block, so no prefix-cache hit muddies prompt_tokens)
    usages = []
    for prompt, max_tokens in [("Metrics one", 5), ("Metrics two 🙂", 7)]:
        usages.append(client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                                 extra_body={"ignore_eos": True}).usage.model_dump())
    usages.append(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Metrics 三"}], max_tokens=4, temperature=0,
        extra_body={"ignore_eos": True}).usage.model_dump())
    chunks = stream_post(server.url(C), {"model": MODEL, "prompt": "Metrics four", "max_tokens": 6,
                                         "ignore_eos": True, "stream": True,
                                         "stream_options": {"include_usage": True}})
    usages.append(final_usage(chunks))
    sent = len(usages)
    assert [u["completion_tokens"] for u in usages] == [5, 7, 4, 6]

    deadline = time.monotonic() + 5
    while True:   # the stats of a finished request may land a moment after its response
        after = scrape(server)
        diff = lambda fam, sample=None, **labels: (  # noqa: E731
            metric(after, fam, sample, **labels) - metric(before, fam, sample, **labels))
        if diff("twostep:request_success") >= sent or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert diff("twostep:request_success") == sent
    assert diff("twostep:request_success", finished_reason="length") == sent
    assert diff("twostep:generation_tokens") == sum(u["completion_tokens"] for u in usages)
    assert diff("twostep:prompt_tokens") == sum(u["prompt_tokens"] for u in usages)
    for name in ("e2e_request_latency_seconds", "time_to_first_token_seconds",
                 "request_queue_time_seconds", "request_prefill_time_seconds"):
        fam = "twostep:" + name
        assert diff(fam, fam + "_count") == sent, name
        assert diff(fam, fam + "_bucket", le="+Inf") == sent, name
        assert diff(fam, fam + "_sum") > 0, name
    itl = "twostep:inter_token_latency_seconds"
    assert diff(itl, itl + "_count") == sum(u["completion_tokens"] - 1 for u in usages)
    assert diff("twostep:prefix_cache_queries") >= 0 and diff("twostep:prefix_cache_hits") >= 0
    state = wait_idle(server, 5)
    assert all(v == 0 for v in state.values()), state


# ---- 6. load ------------------------------------------------------------------------------------

@pytest.mark.slow
def test_100_concurrent_streams_all_complete(server):
    prompts = ["Once upon a time", "你好 🙂", "The quick brown fox", "café 🚀 naïve", "What is"]
    before = scrape(server)

    async def one(c: httpx.AsyncClient, i: int):
        max_tokens = 1 + (i * 7) % 32
        body = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0.8, "seed": i, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        chat = i % 2 == 1
        if chat:
            body["messages"] = [{"role": "user", "content": f"{i} {prompts[i % len(prompts)]}"}]
        else:
            body["prompt"] = f"{i}: {prompts[i % len(prompts)]}"
        async with c.stream("POST", server.url(CH if chat else C), json=body) as r:
            lines = [line async for line in r.aiter_lines()]
            assert r.status_code == 200, (i, r.status_code, lines[:3])
        chunks = parse_sse(lines)
        usage = final_usage(chunks)
        assert usage["completion_tokens"] == max_tokens, (i, usage)
        assert finish_reasons(chunks) == {0: "length"}, i
        content_chunks = sum(1 for ch in chunks for x in ch["choices"]
                             if (x["delta"].get("content") if chat else x["text"]))
        assert content_chunks <= max_tokens, (i, content_chunks)
        return usage

    async def main():
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
        async with httpx.AsyncClient(timeout=120, limits=limits) as c:
            return await asyncio.gather(*(one(c, i) for i in range(100)), return_exceptions=True)

    t0 = time.monotonic()
    results = asyncio.run(main())
    elapsed = time.monotonic() - t0
    failed = [(i, r) for i, r in enumerate(results) if isinstance(r, BaseException)]
    assert not failed, f"{len(failed)} of 100 failed, e.g. {failed[:3]!r}"
    assert len(results) == 100
    state = wait_idle(server, 5)
    assert all(v == 0 for v in state.values()), state
    after = scrape(server)
    assert metric(after, "twostep:request_success") - metric(before, "twostep:request_success") == 100
    assert (metric(after, "twostep:generation_tokens") - metric(before, "twostep:generation_tokens")
            == sum(u["completion_tokens"] for u in results))
    assert elapsed < 90


# ---- 5. the waiting-queue limit ------------------------------------------------------------------

def test_queue_limit_gives_503_and_the_rest_complete(limited_server):
    n = 10
    barrier = threading.Barrier(n)
    responses: list = [None] * n

    def send(i: int):
        body = {"model": MODEL, "prompt": f"{i} {EMOJI}", "max_tokens": 300, "temperature": 0,
                "ignore_eos": True}
        try:
            with httpx.Client(timeout=120) as c:
                barrier.wait(10)
                responses[i] = c.post(limited_server.url(C), json=body)
        except BaseException as e:
            responses[i] = e

    threads = [threading.Thread(target=send, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(150)
    errors = [r for r in responses if not isinstance(r, httpx.Response)]
    assert not errors, errors
    statuses = sorted(r.status_code for r in responses)
    assert set(statuses) <= {200, 503}, statuses
    rejected = [r for r in responses if r.status_code == 503]
    done = [r for r in responses if r.status_code == 200]
    assert rejected, f"no 503 with 1 running and at most 2 waiting: {statuses}"
    assert done, statuses
    for r in rejected:
        assert_error(r, 503)
        assert r.headers["retry-after"] == "1"
    for r in done:
        body = r.json()
        assert body["usage"]["completion_tokens"] == 300 and body["choices"][0]["finish_reason"] == "length"
    # the server takes work again once the queue has drained
    r = httpx.post(limited_server.url(C), json={"model": MODEL, "prompt": "again", "max_tokens": 3,
                                                "ignore_eos": True}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


# ---- typed fields, /tokenize inputs, logprob limits: 400 JSON naming the field --------------------

@pytest.mark.parametrize("path,field,value", [
    (C, "max_tokens", "16"), (C, "stream", "yes"), (C, "n", 2.0), (CH, "temperature", "0.5"),
    (CH, "logprobs", 1), (C, "seed", True)])
def test_strings_and_floats_are_not_coerced_into_typed_fields(server, path, field, value):
    body = {"model": MODEL, "max_tokens": 2, field: value}
    body |= {"messages": [{"role": "user", "content": "hi"}]} if path == CH else {"prompt": "hi"}
    r = httpx.post(server.url(path), json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


def test_tokenize_refuses_bad_messages_with_json_and_takes_text_parts(server):
    r = httpx.post(server.url("/tokenize"), json={"messages": []}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    r = httpx.post(server.url("/tokenize"), timeout=30,
                   json={"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]})
    assert r.status_code == 400 and "text content parts" in r.json()["error"]["message"], r.text
    parts = [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "world"}]
    joined = httpx.post(server.url("/tokenize"), json={"messages": [{"role": "user", "content": "Hello, world"}]},
                        timeout=30).json()
    r = httpx.post(server.url("/tokenize"), json={"messages": [{"role": "user", "content": parts}]}, timeout=30)
    assert r.status_code == 200 and r.json()["tokens"] == joined["tokens"]


def test_a_logprob_count_over_the_limit_names_its_field(server):
    r = httpx.post(server.url(CH), timeout=30, json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                     "logprobs": True, "top_logprobs": 50, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs", r.text
    assert "top_logprobs must be <= 20" in r.json()["error"]["message"]
    r = httpx.post(server.url(C), json={"model": MODEL, "prompt": "hi", "logprobs": 21, "max_tokens": 2}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs", r.text


# ---- limits: templates from requests, sizes, fan-out, prompt + max_tokens ----------------------------

LOOP = "{% for i in range(2000) %}{% for j in range(20000) %}{% endfor %}{% endfor %}hi"


def test_a_request_cannot_send_a_template_or_tools_through_chat_template_kwargs(server):
    for kwargs in ({"chat_template": LOOP}, {"tools": [{"type": "function"}]}, {"x": {"nested": 1}}):
        t0 = time.monotonic()
        r = httpx.post(server.url(CH), timeout=30, json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "chat_template_kwargs": kwargs})
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs", r.text
        assert time.monotonic() - t0 < 1.0
    r = httpx.post(server.url(CH), timeout=30, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "chat_template_kwargs": {"enable_thinking": False}})
    assert r.status_code == 200, r.text


def test_a_trusted_template_renders_off_the_event_loop(model_dir, log_dir):
    """With --trust-request-chat-template a slow template keeps one worker busy, not the server."""
    import threading

    for trusted in serving(model_dir, log_dir, "--trust-request-chat-template"):
        result = {}
        slow = threading.Thread(target=lambda: result.update(r=httpx.post(trusted.url(CH), timeout=120, json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "chat_template_kwargs": {"chat_template": LOOP}})))
        slow.start()
        time.sleep(0.3)
        for _ in range(3):
            t0 = time.monotonic()
            assert httpx.get(trusted.url("/health"), timeout=5).status_code == 200
            assert time.monotonic() - t0 < 1.0
            time.sleep(0.2)
        slow.join(120)
        assert result["r"].status_code == 200, result["r"].text


def test_the_server_takes_its_chat_template_from_a_file(model_dir, log_dir, tmp_path):
    template = tmp_path / "brackets.jinja"
    template.write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    for server in serving(model_dir, log_dir, "--chat-template", str(template)):
        ids = httpx.post(server.url("/tokenize"), json={"messages": [{"role": "user", "content": "hi"}]},
                         timeout=30).json()["tokens"]
        plain = httpx.post(server.url("/tokenize"), json={"prompt": "[hi]", "add_special_tokens": False},
                           timeout=30).json()["tokens"]
        assert ids == plain


def test_oversized_bodies_and_prompts_are_refused_at_once(server):
    """...while a stream in flight keeps going."""
    import threading

    streamed = {}
    stream = threading.Thread(target=lambda: streamed.update(chunks=stream_post(server.url(C), {
        "model": MODEL, "prompt": "Once upon a time", "max_tokens": 40, "ignore_eos": True, "stream": True})))
    stream.start()
    t0 = time.monotonic()
    r = httpx.post(server.url(C), timeout=30, content=b'{"model": "tiny", "prompt": "' + b"a" * (20 << 20) + b'"}',
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == 413, r.text[:200]
    r = httpx.post(server.url("/tokenize"), json={"prompt": "word " * (1 << 20)}, timeout=30)
    assert r.status_code == 413
    chunks = (b'{"model": "tiny", "prompt": "' if i == 0 else b"a" * (1 << 20) for i in range(6))
    r = httpx.post(server.url(C), timeout=30, content=chunks, headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and "--max-request-body-bytes" in r.json()["error"]["message"]   # chunked
    # under the body limit, but more characters than max_model_len tokens can spell: no tokenizing
    r = httpx.post(server.url(C), json={"model": MODEL, "prompt": "word " * 200_000}, timeout=30)
    assert r.status_code == 400 and "characters" in r.json()["error"]["message"], r.text
    assert time.monotonic() - t0 < 3.0
    stream.join(60)
    assert stream_text(streamed["chunks"], chat=False)[0] and streamed["chunks"][-1]["choices"][0]["finish_reason"]


def test_prompt_and_max_tokens_must_fit_max_model_len(server):
    r = httpx.post(server.url(C), json={"model": MODEL, "prompt": ""}, timeout=30)
    assert r.status_code == 400 and "empty" in r.json()["error"]["message"]
    r = httpx.post(server.url(C), json={"model": MODEL, "prompt": random_prompts([70], seed=3)[0]}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    r = httpx.post(server.url(C), json={"model": MODEL, "prompt": random_prompts([60], seed=3)[0]}, timeout=30)
    assert r.status_code == 400 and "max_tokens 16 (the default)" in r.json()["error"]["message"], r.text
    prompt = random_prompts([40], seed=3)[0]
    r = httpx.post(server.url(C), json={"model": MODEL, "prompt": prompt, "max_tokens": 30}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    assert "40 prompt tokens and max_tokens 30: 70 is over max_model_len 64" in r.json()["error"]["message"]
    r = httpx.post(server.url(C), json={"model": MODEL, "prompt": prompt, "max_tokens": 24}, timeout=30)
    assert r.status_code == 200
    r = httpx.post(server.url(CH), timeout=30, json={"model": MODEL, "max_tokens": 64,
                                                     "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and "max_model_len 64" in r.json()["error"]["message"]
    r = httpx.post(server.url(CH), timeout=30, json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200          # max_tokens unset: up to max_model_len


def test_a_default_server_bounds_what_one_request_queues(server):
    """No --max-queued-requests: the limit is 4 x --max-num-seqs (64), never unbounded."""
    body = {"model": MODEL, "max_tokens": 1, "prompt": ["hi"] * 200, "n": 128}
    r = httpx.post(server.url(C), json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "n"
    assert "25600 sequences (200 prompts x n 128)" in error["message"] and "at most 256" in error["message"]
    r = httpx.post(server.url(C), json={**body, "prompt": ["hi"] * 2, "n": 128}, timeout=60)
    assert r.status_code == 200 and len(r.json()["choices"]) == 256


def test_a_queue_bound_below_one_is_refused_at_start_up():
    from twostep.entrypoints.openai.server import ServerConfig

    with pytest.raises(ValueError, match="--max-queued-requests must be at least 1"):
        ServerConfig("tiny", max_queued_requests=0)


def test_one_request_cannot_queue_more_than_the_queue_holds(limited_server):
    for body in ({"prompt": ["hi"] * 3}, {"prompt": "hi", "n": 3}, {"prompt": ["hi"] * 2, "n": 2}):
        r = httpx.post(limited_server.url(C), json={"model": MODEL, "max_tokens": 2, **body}, timeout=30)
        assert r.status_code == 400 and "--max-queued-requests" in r.json()["error"]["message"], r.text
    r = httpx.post(limited_server.url(CH), timeout=30, json={
        "model": MODEL, "max_tokens": 2, "n": 3, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400


def test_the_schema_states_what_the_server_sends(server):
    spec = httpx.get(server.url("/openapi.json"), timeout=30).json()
    for path, methods in spec["paths"].items():
        for op in methods.values():
            assert "422" not in op["responses"], path            # invalid input is a 400
            assert op["responses"]["200"].get("content"), path   # no empty {} schemas
    completions = spec["paths"]["/v1/completions"]["post"]["responses"]
    assert completions["400"]["content"]["application/json"]["schema"]["$ref"].endswith("ErrorResponse")
    assert set(completions["200"]["content"]) == {"application/json", "text/event-stream"}
    r = httpx.get(server.url("/health"), timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    assert httpx.get(server.url("/metrics"), timeout=30).headers["content-type"].startswith("text/plain")
    r = httpx.get(server.url("/v1/completions"), timeout=30)
    assert r.status_code == 405 and r.headers["allow"] == "POST" and r.json()["error"]["code"] == 405


# ---- 4. a client that disconnects mid-stream ---------------------------------------------------

def long_request(path: str, **fields) -> dict:
    """A request that would run for far longer than any test waits, on either endpoint."""
    body = {"model": MODEL, "max_tokens": LONG_MAX_TOKENS, "ignore_eos": True, **fields}
    return body | ({"messages": [{"role": "user", "content": CJK}]} if path == CH else {"prompt": CJK})


@pytest.mark.parametrize("path", [C, CH], ids=["completions", "chat"])
def test_disconnect_aborts_and_frees_kv_blocks(limited_server, path):
    body = long_request(path, temperature=0, stream=True)
    assert all(v == 0 for v in wait_idle(limited_server, 10).values())
    with httpx.Client(timeout=30) as c:
        with c.stream("POST", limited_server.url(path), json=body) as r:
            assert r.status_code == 200
            # keep the iterator alive: abandoning it mid-body makes httpcore close the connection
            lines = r.iter_lines()
            seen = 0
            while seen < 5:
                seen += next(lines).startswith("data: ")
            fams = scrape(limited_server)
            assert metric(fams, "twostep:num_requests_running") == 1
            assert metric(fams, "twostep:kv_cache_usage_perc") > 0
    closed = time.monotonic()
    # finishing LONG_MAX_TOKENS tokens would take far longer than this
    state = wait_idle(limited_server, 5)
    assert all(v == 0 for v in state.values()), (
        f"{time.monotonic() - closed:.1f} s after the client went away: {state}")


@pytest.mark.parametrize("path,n", [(C, 1), (CH, 1), (C, 2)], ids=["completions", "chat", "n2"])
def test_a_non_streaming_client_that_leaves_frees_its_requests(limited_server, path, n):
    """The client gives up after a second while tokens keep coming: every choice is aborted."""
    body = long_request(path, temperature=0.5, n=n)
    assert all(v == 0 for v in wait_idle(limited_server, 10).values())
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(limited_server.url(path), json=body, timeout=1.0)
    closed = time.monotonic()
    state = wait_idle(limited_server, 3)
    assert all(v == 0 for v in state.values()), (
        f"{time.monotonic() - closed:.1f} s after the client went away: {state}")


# ---- 8. per-request deadline ---------------------------------------------------------------------

def test_request_timeout_ends_requests_with_a_finish_reason(timeout_server):
    body = {"model": MODEL, "prompt": CJK, "max_tokens": LONG_MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    t0 = time.monotonic()
    r = httpx.post(timeout_server.url(C), json=body, timeout=60)
    elapsed = time.monotonic() - t0
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["choices"][0]["finish_reason"] in ("length", "abort"), out["choices"][0]
    assert out["usage"]["completion_tokens"] < LONG_MAX_TOKENS
    assert elapsed < 10, f"a 0.5 s deadline took {elapsed:.1f} s"

    t0 = time.monotonic()
    chunks = stream_post(timeout_server.url(CH), {"model": MODEL, "messages": [{"role": "user", "content": CJK}],
                                                  "max_tokens": LONG_MAX_TOKENS, "temperature": 0,
                                                  "ignore_eos": True, "stream": True,
                                                  "stream_options": {"include_usage": True}})
    assert time.monotonic() - t0 < 10
    assert finish_reasons(chunks)[0] in ("length", "abort")
    assert final_usage(chunks)["completion_tokens"] < LONG_MAX_TOKENS

    # a short request is untouched by the deadline
    r = httpx.post(timeout_server.url(C), json={**body, "max_tokens": 5}, timeout=60)
    assert r.status_code == 200
    assert r.json()["choices"][0]["finish_reason"] == "length" and r.json()["usage"]["completion_tokens"] == 5
    state = wait_idle(timeout_server, 5)
    assert all(v == 0 for v in state.values()), state


# ---- the command line ----------------------------------------------------------------------------

def test_serve_help_lists_the_server_flags():
    r = subprocess.run([sys.executable, "-m", "twostep.cli", "serve", "--help"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    for flag in ("--host", "--port", "--served-model-name", "--max-queued-requests", "--request-timeout",
                 "--max-model-len", "--kv-cache-memory"):
        assert flag in r.stdout, flag


# ---- graceful shutdown with a request in flight ---------------------------------------------------

def test_sigterm_with_a_stream_in_flight_exits_0(long_model_dir, log_dir):
    server = Server(long_model_dir, log_dir)
    try:
        body = {"model": MODEL, "prompt": CJK, "max_tokens": LONG_MAX_TOKENS, "temperature": 0,
                "ignore_eos": True, "stream": True}
        rest: list[str] = []
        with httpx.Client(timeout=30) as c, c.stream("POST", server.url(C), json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: "):
                    break
            t0 = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            # the stream must end (finished or aborted), not run on for its 16k tokens
            cut = None
            try:
                for line in lines:
                    if line.strip():
                        rest.append(line)
                    assert time.monotonic() - t0 < 15, "the stream ran on for 15 s after SIGTERM"
            except httpx.HTTPError as e:
                cut = e
            ended = time.monotonic() - t0
        # finished or aborted means a clear end: a finish reason and [DONE], not a cut connection
        assert cut is None, (f"{ended:.1f} s after SIGTERM the connection was cut mid-stream ({cut!r}); "
                             f"last lines {rest[-2:]}")
        assert rest and rest[-1] == "data: [DONE]", rest[-2:]
        finals = [json.loads(x[6:]) for x in rest[:-1]]
        assert any(ch.get("finish_reason") for f in finals for ch in f["choices"]), rest[-3:]
        try:
            rc = server.proc.wait(15)
        except subprocess.TimeoutExpired:
            rc = None
        assert rc == 0, f"exit code {rc} after SIGTERM:\n{server.output()}"
    finally:
        server.kill()
