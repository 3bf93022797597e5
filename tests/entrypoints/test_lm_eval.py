"""lm-evaluation-harness against the real server as a vLLM user runs it: local-completions with
tokenizer_backend=remote (the server's /tokenizer_info, /tokenize and /detokenize, no local tokenizer)
on a tiny local task; its loglikelihoods equal the engine's own prompt logprobs."""
from __future__ import annotations

import json
import math

import pytest

from conftest import MODEL, Server
from twostep.entrypoints.llm import LLM
from twostep.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

DOCS = [{"context": "Once upon a time there was a little", "continuation": " girl named Lily."},
        {"context": "The capital of France", "continuation": " is Paris."},
        {"context": "The quick brown fox", "continuation": " jumps over the lazy dog."}]


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("qwen2")


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    server = Server(model_dir, tmp_path_factory.mktemp("lm-eval-logs"), "--max-model-len", "256",
                    "--enable-tokenizer-info-endpoint")
    try:
        yield server
    finally:
        assert server.terminate() == 0, server.output()


def _task(folder) -> str:
    data = folder / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (folder / "twostep_tiny.yaml").write_text(
        "task: twostep_tiny\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {data}\ntest_split: test\noutput_type: loglikelihood\n"
        'doc_to_text: "{{context}}"\ndoc_to_target: "{{continuation}}"\n'
        "metric_list:\n  - metric: perplexity\n  - metric: acc\n")
    return str(folder)


def test_local_completions_with_a_remote_tokenizer(server, model_dir, tmp_path, monkeypatch):
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    info = __import__("httpx").get(server.url("/tokenizer_info")).json()
    assert info["eos_token"] == "</s>" and info["chat_template"] and info["model_max_length"] == 256
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=f"model={MODEL},base_url={server.url('/v1/completions')},tokenizer_backend=remote,"
                   "tokenized_requests=True,num_concurrent=1,max_retries=1",
        tasks=["twostep_tiny"], task_manager=TaskManager(include_path=_task(tmp_path)), log_samples=True)
    samples = sorted(results["samples"]["twostep_tiny"], key=lambda s: s["doc_id"])
    assert len(samples) == len(DOCS)
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory="8MiB", max_model_len=256)
    tok = llm.tokenizer
    for sample, doc in zip(samples, DOCS):
        ll = sample["resps"][0][0][0]
        whole = tok.encode(doc["context"] + doc["continuation"], add_special_tokens=False)
        n_context = len(tok.encode(doc["context"], add_special_tokens=False))
        out = llm.generate({"prompt_token_ids": whole}, SamplingParams(max_tokens=1, prompt_logprobs=0),
                           use_tqdm=False)[0]
        expected = sum(out.prompt_logprobs[i][whole[i]].logprob for i in range(n_context, len(whole)))
        assert ll == pytest.approx(expected, abs=1e-4), (sample, expected)
    perplexity = results["results"]["twostep_tiny"]["perplexity,none"]
    assert math.isfinite(perplexity) and perplexity > 1
