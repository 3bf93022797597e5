"""`--api-key`: Bearer authentication on every route but /health (and /metrics unless asked), and a
served name that carries no filesystem path. Real servers on loopback ports, real clients."""
from __future__ import annotations

import httpx
import openai
import pytest

from conftest import Server

KEY = "sk-test-4f2a"


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("qwen2")


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("auth-logs")


def serve(*args, **kw):
    server = Server(*args, **kw)
    try:
        yield server
    finally:
        server.terminate()


@pytest.fixture(scope="module")
def keyed(model_dir, log_dir):
    yield from serve(model_dir, log_dir, "--api-key", KEY)


def test_requests_without_the_key_get_an_openai_shaped_401(keyed):
    for method, path, body in (("GET", "/v1/models", None), ("POST", "/v1/completions",
                                                             {"model": "tiny", "prompt": "hi"}),
                               ("POST", "/tokenize", {"prompt": "hi"}), ("GET", "/openapi.json", None)):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            r = httpx.request(method, keyed.url(path), json=body, headers=headers, timeout=10)
            assert r.status_code == 401, (path, headers, r.text)
            assert r.json()["error"]["code"] == 401 and "API key" in r.json()["error"]["message"]
            assert r.headers["www-authenticate"] == "Bearer"


def test_the_key_opens_every_route_and_health_and_metrics_stay_open(keyed):
    auth = {"Authorization": f"Bearer {KEY}"}
    assert httpx.get(keyed.url("/v1/models"), headers=auth, timeout=10).status_code == 200
    assert httpx.post(keyed.url("/tokenize"), json={"prompt": "hi"}, headers=auth, timeout=10).status_code == 200
    assert httpx.get(keyed.url("/health"), timeout=10).status_code == 200
    assert httpx.get(keyed.url("/metrics"), timeout=10).status_code == 200
    client = openai.OpenAI(base_url=keyed.url("/v1"), api_key=KEY)
    out = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=4, temperature=0)
    assert out.choices[0].text and out.usage.completion_tokens == 4
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=keyed.url("/v1"), api_key="nope").models.list()


def test_the_key_can_come_from_the_environment_and_guard_metrics(model_dir, log_dir):
    for server in serve(model_dir, log_dir, "--api-key-for-metrics", env={"VLLM_API_KEY": KEY}):
        assert httpx.get(server.url("/metrics"), timeout=10).status_code == 401
        assert httpx.get(server.url("/metrics"), headers={"Authorization": f"Bearer {KEY}"},
                         timeout=10).status_code == 200
        assert httpx.get(server.url("/health"), timeout=10).status_code == 200


def test_the_served_name_is_the_folders_name_and_no_path_is_shown(model_dir, log_dir):
    for server in serve(model_dir, log_dir, served_name=None):
        models = httpx.get(server.url("/v1/models"), timeout=10).json()["data"]
        assert [m["id"] for m in models] == [model_dir.name]
        assert models[0]["root"] == model_dir.name and str(model_dir) not in str(models)
        r = httpx.post(server.url("/v1/completions"), timeout=30,
                       json={"model": model_dir.name, "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200 and str(model_dir) not in r.text


def test_served_model_name_defaults():
    import argparse

    from twostep.cli import served_model_name

    def name(model, served=None):
        return served_model_name(argparse.Namespace(model=model, served_model_name=served))

    assert name(None) == "SmolLM2-135M-Instruct"
    assert name("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"   # a hub id as given
    assert name(__file__) == "test_server_auth"                                  # a file: its stem
    assert name(".", "mine") == "mine"


def test_a_public_host_without_a_key_is_warned_about(model_dir, log_dir):
    for server in serve(model_dir, log_dir, "--host", "0.0.0.0"):
        assert httpx.get(server.url("/health"), timeout=10).status_code == 200
        assert "without an API key" in server.output()


def test_behind_the_key_a_non_streaming_client_that_leaves_still_frees_its_request(tmp_path_factory, log_dir):
    from conftest import make_tiny_model, metric, scrape

    long_model = make_tiny_model(tmp_path_factory.mktemp("long"), "qwen2", max_position_embeddings=16384)
    for server in serve(long_model, log_dir, "--api-key", KEY):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url("/v1/completions"), headers={"Authorization": f"Bearer {KEY}"}, timeout=1.0,
                       json={"model": "tiny", "prompt": "hi", "max_tokens": 12000, "ignore_eos": True})
        import time

        deadline = time.monotonic() + 5
        while metric(scrape(server), "twostep:num_requests_running") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert metric(scrape(server), "twostep:num_requests_running") == 0


def test_the_model_may_be_named_by_the_path_it_was_served_from(model_dir, log_dir):
    for server in serve(model_dir, log_dir, served_name=None):
        r = httpx.post(server.url("/v1/completions"), timeout=30,
                       json={"model": str(model_dir), "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["model"] == model_dir.name
