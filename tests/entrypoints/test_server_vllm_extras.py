"""vLLM's request extras and what the OpenAI SDKs send, through the real server on a tiny model:
unknown fields are ignored and named, request_id, truncate_prompt_tokens, prompt_logprobs,
return_tokens_as_token_ids, continue_final_message and echo for chat, /version, /v1/models/{id}."""
from __future__ import annotations

import re

import httpx
import pytest

from conftest import MODEL, Server
from twostep.tokenizer.tokenizer import Tokenizer

PROMPT = "Once upon a time there was a little girl named Lily."


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("qwen2")


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    server = Server(model_dir, tmp_path_factory.mktemp("extras-logs"), "--max-model-len", "256")
    try:
        yield server
    finally:
        assert server.terminate() == 0, server.output()


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url(path), json={"model": MODEL, **body}, timeout=60.0)


def _ok(server, path, body) -> dict:
    r = _post(server, path, body)
    assert r.status_code == 200, r.text
    return r.json()


GREEDY = {"temperature": 0, "max_tokens": 6, "ignore_eos": True}


def test_unknown_fields_are_ignored_named_and_logged(server):
    sdk = {"store": False, "metadata": {"k": "v"}, "service_tier": "auto", "reasoning_effort": "low",
           "prediction": {"type": "content", "content": "x"}, "frobnicate": 1}
    for path, body in (("/v1/completions", {"prompt": PROMPT}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        r = _post(server, path, {**body, **GREEDY, **sdk})
        assert r.status_code == 200, r.text
        assert r.headers["x-ignored-fields"] == ", ".join(sorted(sdk))
        plain = _post(server, path, {**body, **GREEDY})
        assert "x-ignored-fields" not in plain.headers
        assert r.json()["choices"][0] == plain.json()["choices"][0]     # ignored means no effect
    with httpx.stream("POST", server.url("/v1/completions"),
                      json={"model": MODEL, "prompt": PROMPT, "stream": True, "store": True, **GREEDY}) as r:
        assert r.headers["x-ignored-fields"] == "store"
        r.read()
    assert "ignored request fields: frobnicate, metadata" in server.output()


def test_request_id_names_the_response(server):
    assert _ok(server, "/v1/completions", {"prompt": PROMPT, "request_id": "abc-1", **GREEDY})["id"] == "cmpl-abc-1"
    chat = _ok(server, "/v1/chat/completions",
               {"messages": [{"role": "user", "content": "hi"}], "request_id": "abc-2", **GREEDY})
    assert chat["id"] == "chatcmpl-abc-2"


def test_truncate_prompt_tokens_keeps_the_last_tokens(server):
    ids = _ok(server, "/tokenize", {"prompt": PROMPT})["tokens"]
    assert len(ids) > 6
    cut = _ok(server, "/v1/completions", {"prompt": PROMPT, "truncate_prompt_tokens": 5, **GREEDY})
    last = _ok(server, "/v1/completions", {"prompt": ids[-5:], **GREEDY})
    assert cut["usage"]["prompt_tokens"] == 5
    assert cut["choices"][0]["text"] == last["choices"][0]["text"]


def test_prompt_logprobs_match_echo_logprobs(server):
    body = _ok(server, "/v1/completions", {"prompt": PROMPT, "prompt_logprobs": 2, **GREEDY})
    ids = _ok(server, "/tokenize", {"prompt": PROMPT})["tokens"]
    plp = body["choices"][0]["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    echo = _ok(server, "/v1/completions", {"prompt": PROMPT, "echo": True, "logprobs": 1, **GREEDY})
    echo_lps = echo["choices"][0]["logprobs"]["token_logprobs"][:len(ids)]
    for tid, entry, expected in zip(ids[1:], plp[1:], echo_lps[1:]):
        assert str(tid) in entry and 2 <= len(entry) <= 3
        assert entry[str(tid)]["logprob"] == pytest.approx(expected, abs=1e-5)
        assert entry[str(tid)]["rank"] >= 1 and isinstance(entry[str(tid)]["decoded_token"], str)
    chat = _ok(server, "/v1/chat/completions",
               {"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 0, **GREEDY})
    assert chat["prompt_logprobs"][0] is None
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]


def test_return_tokens_as_token_ids(server):
    body = _ok(server, "/v1/completions", {"prompt": PROMPT, "logprobs": 2, "return_tokens_as_token_ids": True,
                                           **GREEDY})
    lp = body["choices"][0]["logprobs"]
    ids = [int(re.fullmatch(r"token_id:(\d+)", t).group(1)) for t in lp["tokens"]]
    assert _ok(server, "/detokenize", {"tokens": ids})["prompt"] == body["choices"][0]["text"]
    assert all(re.fullmatch(r"token_id:\d+", k) for top in lp["top_logprobs"] for k in top)
    chat = _ok(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                                                "top_logprobs": 1, "return_tokens_as_token_ids": True, **GREEDY})
    assert all(re.fullmatch(r"token_id:\d+", c["token"]) for c in chat["choices"][0]["logprobs"]["content"])


def test_continue_final_message_and_echo(server, model_dir):
    messages = [{"role": "user", "content": "Tell me a story."},
                {"role": "assistant", "content": "Once upon a time"}]
    body = {"messages": messages, "continue_final_message": True, "add_generation_prompt": False, **GREEDY}
    r = _ok(server, "/v1/chat/completions", body)
    text = Tokenizer.from_folder(model_dir).apply_chat_template(messages, add_generation_prompt=False,
                                                                continue_final_message=True)
    assert text.endswith("Once upon a time")
    assert r["usage"]["prompt_tokens"] == len(_ok(server, "/tokenize", {"prompt": text,
                                                                         "add_special_tokens": False})["tokens"])
    echoed = _ok(server, "/v1/chat/completions", {**body, "echo": True})
    assert echoed["choices"][0]["message"]["content"] == "Once upon a time" + r["choices"][0]["message"]["content"]


def test_version_and_one_model(server):
    assert re.fullmatch(r"\d+\.\d+\.\d+.*", httpx.get(server.url("/version")).json()["version"])
    card = httpx.get(server.url(f"/v1/models/{MODEL}")).json()
    assert card["id"] == MODEL and card["max_model_len"] == 256
    missing = httpx.get(server.url("/v1/models/nope"))
    assert missing.status_code == 404 and "nope" in missing.json()["error"]["message"]


def test_ignored_field_names_are_escaped_and_capped(server):
    body = {"prompt": PROMPT, **GREEDY, "caf\u00e9": 1, **{f"f{i:02d}": i for i in range(25)}}
    r = _post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    header = r.headers["x-ignored-fields"]
    assert header.startswith("caf\\u00e9, f00, f01") and header.endswith("f18, ... (6 more)")


def test_priority_needs_the_priority_policy(server, model_dir, tmp_path):
    r = _post(server, "/v1/completions", {"prompt": PROMPT, "priority": 2, **GREEDY})
    assert r.status_code == 400 and "--scheduling-policy priority" in r.json()["error"]["message"]
    prio = Server(model_dir, tmp_path, "--max-model-len", "256", "--scheduling-policy", "priority")
    try:
        for priority in (-3, 0, 7):
            assert _ok(prio, "/v1/completions", {"prompt": PROMPT, "priority": priority, **GREEDY})["choices"]
    finally:
        assert prio.terminate() == 0, prio.output()


def test_the_openai_sdk_with_its_extra_fields(server):
    import openai

    with openai.OpenAI(base_url=server.url("/v1"), api_key="x", max_retries=0, timeout=60.0) as client:
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0,
            store=False, metadata={"run": "1"}, service_tier="auto", reasoning_effort="low", user="u",
            prediction={"type": "content", "content": "x"}, modalities=["text"])
        assert raw.headers["x-ignored-fields"] == "metadata, prediction, reasoning_effort, service_tier, store"
        assert raw.parse().choices[0].message.content is not None
        with pytest.raises(openai.BadRequestError, match="beam search"):
            client.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body={"use_beam_search": True})


@pytest.mark.parametrize("path,body", [("/v1/completions", {"prompt": PROMPT}),
                                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})])
def test_max_tokens_0_without_echo_is_vllms_400(server, path, body):
    r = _post(server, path, {**body, "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("max_tokens must be at least 1, got 0")
    assert r.json()["error"]["param"] == "max_tokens"
