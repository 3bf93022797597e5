"""A `twostep serve --runner pooling` server driven by real clients: OpenAI's SDK embeddings (floats,
base64, dimensions), LangChain's OpenAIEmbeddings, /v1/rerank and /v1/score with httpx against a
cross-encoder and an embedding model, each checked against transformers; bad input gets 400 in
OpenAI's shape, a generating server answers the pooling routes 400 and a pooling server the
generating ones."""
from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import MODEL, Server, make_tiny_model, serving, tokenize

TOL = 1e-4
TEXTS = ["Once upon a time there was a little girl named Lily.", "The quick brown fox jumps over the lazy dog.",
         "What is the capital of France? The capital of France is Paris."]
QUERY = "What is the capital of France?"
DOCUMENTS = ["The capital of France is Paris.", "Lily loved to play outside.", "The quick brown fox.",
             "Paris is in France."]


def serve(tmp_path_factory, folder, *extra):
    yield from serving(folder, tmp_path_factory.mktemp("pooling-logs"), "--max-model-len", "64",
                       "--max-num-batched-tokens", "16", *extra)


@pytest.fixture(scope="module")
def embedder_dir(tmp_path_factory):
    """A Qwen3Model (Qwen3-Embedding's form) whose config says it is a Matryoshka model."""
    return make_tiny_model(tmp_path_factory.mktemp("embedder"), "qwen3", auto_class="AutoModel", is_matryoshka=True)


@pytest.fixture(scope="module")
def embedder(tmp_path_factory, embedder_dir):
    yield from serve(tmp_path_factory, embedder_dir)


@pytest.fixture(scope="module")
def mean_embedder(tmp_path_factory):
    """A plain base model (no Matryoshka) pooled by the mean, set on the command line."""
    yield from serve(tmp_path_factory, make_tiny_model(tmp_path_factory.mktemp("plain"), "qwen3", auto_class="AutoModel"),
                     "--pooling-type", "mean")


@pytest.fixture(scope="module")
def reranker_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("reranker"), "qwen3",
                           auto_class="AutoModelForSequenceClassification", num_labels=1)


@pytest.fixture(scope="module")
def reranker(tmp_path_factory, reranker_dir):
    yield from serve(tmp_path_factory, reranker_dir)


@pytest.fixture(scope="module")
def generator(tmp_path_factory, tiny_model_dir):
    yield from serving(tiny_model_dir("llama"), tmp_path_factory.mktemp("generate-logs"))


@pytest.fixture(scope="module")
def oracle(embedder_dir):
    """transformers' normalised last-token hidden state of a token sequence (and the raw one)."""
    import transformers

    hf = transformers.AutoModel.from_pretrained(embedder_dir, dtype=torch.float32).eval()

    def run(ids: list[int], normalize: bool = True) -> torch.Tensor:
        with torch.no_grad():
            last = hf(torch.tensor([ids])).last_hidden_state[0, -1]
        return F.normalize(last, dim=-1) if normalize else last
    return run


def post(server: Server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url(path), json=body, timeout=60)


def ok(server: Server, path: str, body: dict) -> dict:
    r = post(server, path, body)
    assert r.status_code == 200, r.text
    return r.json()


def test_openai_sdk_embeddings_in_floats_base64_and_fewer_dimensions(embedder, oracle):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=embedder.url("/v1"), api_key="x", max_retries=0)
    by_default = client.embeddings.create(model=MODEL, input=TEXTS)          # the SDK asks for base64
    floats = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    ids = [tokenize(embedder, t)["tokens"] for t in TEXTS]
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == sum(map(len, ids))
    assert [d.index for d in floats.data] == [0, 1, 2] and floats.model == MODEL
    for ids_i, a, b in zip(ids, by_default.data, floats.data):
        # float32 either way; a second request differs only in rounding (its prompt hits the prefix cache)
        assert a.embedding == pytest.approx(b.embedding, abs=1e-6)
        torch.testing.assert_close(torch.tensor(b.embedding), oracle(ids_i), atol=TOL, rtol=0)
    raw = ok(embedder, "/v1/embeddings", {"model": MODEL, "input": TEXTS[0], "encoding_format": "base64"})
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    assert decoded.tolist() == pytest.approx(floats.data[0].embedding, abs=1e-6)
    short = client.embeddings.create(model=MODEL, input=TEXTS[0], dimensions=16, encoding_format="float")
    assert len(short.data[0].embedding) == 16
    torch.testing.assert_close(torch.tensor(short.data[0].embedding),
                               F.normalize(oracle(ids[0], normalize=False)[:16], dim=-1), atol=TOL, rtol=0)


def test_token_ids_in_and_vectors_unnormalised(embedder, oracle):
    ids = [tokenize(embedder, t)["tokens"] for t in TEXTS[:2]]
    one = ok(embedder, "/v1/embeddings", {"input": ids[0], "encoding_format": "float"})["data"]
    both = ok(embedder, "/v1/embeddings", {"input": ids, "normalize": False})["data"]
    assert len(one) == 1 and len(both) == 2
    torch.testing.assert_close(torch.tensor(one[0]["embedding"]), oracle(ids[0]), atol=TOL, rtol=0)
    for i, d in enumerate(both):
        torch.testing.assert_close(torch.tensor(d["embedding"]), oracle(ids[i], normalize=False), atol=TOL, rtol=0)


def test_langchain_openai_embeddings(embedder):
    langchain_openai = pytest.importorskip("langchain_openai")
    embeddings = langchain_openai.OpenAIEmbeddings(model=MODEL, base_url=embedder.url("/v1"), api_key="x",
                                                   check_embedding_ctx_length=False, max_retries=0)
    documents = embeddings.embed_documents(TEXTS)
    query = embeddings.embed_query(QUERY)
    expected = ok(embedder, "/v1/embeddings", {"input": TEXTS + [QUERY]})["data"]
    for got, want in zip(documents + [query], expected):
        assert got == pytest.approx(want["embedding"], abs=1e-6)


def test_mean_pooling_from_the_command_line(mean_embedder):
    import transformers

    text = " ".join(TEXTS)
    out = ok(mean_embedder, "/v1/embeddings", {"input": text})
    ids = tokenize(mean_embedder, text)["tokens"]
    assert len(ids) > 16                      # more than one step's budget: pooled over chunks
    folder = mean_embedder.cmd[mean_embedder.cmd.index("--model") + 1]
    hf = transformers.AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = F.normalize(hf(torch.tensor([ids])).last_hidden_state[0].mean(dim=0), dim=-1)
    torch.testing.assert_close(torch.tensor(out["data"][0]["embedding"]), expected, atol=TOL, rtol=0)


@pytest.fixture(scope="module")
def relevance(reranker_dir):
    """The cross-encoder's sigmoid(logit) of (query, document), as transformers scores a pair."""
    import transformers

    hf = transformers.AutoModelForSequenceClassification.from_pretrained(reranker_dir, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(reranker_dir)

    def run(a: str, b: str) -> float:
        with torch.no_grad():
            return torch.sigmoid(hf(torch.tensor([tok(a, b)["input_ids"]])).logits[0, 0]).item()
    return run


@pytest.mark.parametrize("path", ["/v1/rerank", "/rerank", "/v2/rerank"])
def test_rerank_orders_documents_by_the_cross_encoders_score(reranker, relevance, path):
    expected = [relevance(QUERY, d) for d in DOCUMENTS]
    out = ok(reranker, path, {"model": MODEL, "query": QUERY, "documents": DOCUMENTS})
    assert [r["index"] for r in out["results"]] == sorted(range(4), key=lambda i: -expected[i])
    for r in out["results"]:
        assert r["relevance_score"] == pytest.approx(expected[r["index"]], abs=TOL)
        assert r["document"] == {"text": DOCUMENTS[r["index"]]}
    assert out["usage"]["total_tokens"] > 0 and out["model"] == MODEL
    top = ok(reranker, path, {"query": QUERY, "documents": DOCUMENTS, "top_n": 2, "return_documents": False})
    assert [r["index"] for r in top["results"]] == [r["index"] for r in out["results"][:2]]
    assert all("document" not in r for r in top["results"])


def test_score_one_to_many_and_pair_by_pair(reranker, relevance):
    many = ok(reranker, "/v1/score", {"model": MODEL, "text_1": QUERY, "text_2": DOCUMENTS})
    pairs = ok(reranker, "/v1/score", {"text_1": [QUERY, DOCUMENTS[0]], "text_2": DOCUMENTS[:2]})
    logit = ok(reranker, "/v1/score", {"text_1": QUERY, "text_2": DOCUMENTS[0], "activation": False})
    assert [d["index"] for d in many["data"]] == [0, 1, 2, 3] and many["object"] == "list"
    for d, doc in zip(many["data"], DOCUMENTS):
        assert d["score"] == pytest.approx(relevance(QUERY, doc), abs=TOL)
    assert pairs["data"][1]["score"] == pytest.approx(relevance(DOCUMENTS[0], DOCUMENTS[1]), abs=TOL)
    p = relevance(QUERY, DOCUMENTS[0])
    assert logit["data"][0]["score"] == pytest.approx(np.log(p / (1 - p)), abs=1e-3)


def test_an_embedding_model_scores_by_cosine_similarity(embedder):
    scores = ok(embedder, "/v1/score", {"text_1": QUERY, "text_2": DOCUMENTS})["data"]
    vectors = [torch.tensor(d["embedding"]) for d in
               ok(embedder, "/v1/embeddings", {"input": [QUERY] + DOCUMENTS, "encoding_format": "float"})["data"]]
    for s, v in zip(scores, vectors[1:]):
        assert s["score"] == pytest.approx(F.cosine_similarity(vectors[0], v, dim=0).item(), abs=1e-5)
    ranked = ok(embedder, "/v1/rerank", {"query": QUERY, "documents": DOCUMENTS})["results"]
    assert [r["index"] for r in ranked] == sorted(range(4), key=lambda i: -scores[i]["score"])


BAD = [
    ("embedder", "/v1/embeddings", {"input": ""}, "empty"),
    ("embedder", "/v1/embeddings", {"input": []}, "empty"),
    ("embedder", "/v1/embeddings", {"input": ["a", ""]}, "empty"),
    ("embedder", "/v1/embeddings", {"input": 5}, "input"),
    ("embedder", "/v1/embeddings", {"input": [1, "a"]}, "input"),
    ("embedder", "/v1/embeddings", {"input": [1, 10**6]}, "out of range"),
    ("embedder", "/v1/embeddings", {"input": [5] * 65}, "max_model_len is 64"),
    ("embedder", "/v1/embeddings", {"input": "a", "encoding_format": "binary"}, "encoding_format"),
    ("embedder", "/v1/embeddings", {"input": "a", "dimensions": 0}, "dimensions"),
    ("embedder", "/v1/embeddings", {"input": "a", "dimensions": 65}, "more than"),
    ("embedder", "/v1/embeddings", {"input": "a", "dimensions": "8"}, "dimensions"),
    ("embedder", "/v1/embeddings", {"input": "a", "temperature": 1}, "temperature"),
    ("mean_embedder", "/v1/embeddings", {"input": "a", "dimensions": 8}, "matryoshka"),
    ("reranker", "/v1/embeddings", {"input": "a"}, "classifies"),
    ("reranker", "/v1/rerank", {"query": QUERY, "documents": []}, "documents"),
    ("reranker", "/v1/rerank", {"query": "", "documents": ["a"]}, "query"),
    ("reranker", "/v1/rerank", {"query": QUERY, "documents": ["a"], "top_n": -1}, "top_n"),
    ("reranker", "/v1/score", {"text_1": [QUERY] * 2, "text_2": DOCUMENTS}, "text_1 has 2 texts"),
    ("reranker", "/v1/score", {"text_1": QUERY, "text_2": []}, "at least one"),
    ("reranker", "/v1/score", {"text_1": QUERY, "text_2": [7]}, "text_2"),
    ("embedder", "/v1/completions", {"prompt": "a", "max_tokens": 2}, "pooling model"),
    ("embedder", "/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}]}, "pooling model"),
    ("generator", "/v1/embeddings", {"input": "a"}, "--runner pooling"),
    ("generator", "/v1/rerank", {"query": "a", "documents": ["b"]}, "--runner pooling"),
    ("generator", "/v1/score", {"text_1": "a", "text_2": "b"}, "--runner pooling"),
]


@pytest.mark.parametrize("name,path,body,message", BAD, ids=[f"{n}{p}-{i}" for i, (n, p, _, _) in enumerate(BAD)])
def test_bad_requests_get_400_in_openais_shape(request, name, path, body, message):
    server = request.getfixturevalue(name)
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert message in error["message"] + str(error["param"]) and error["code"] == 400, error


def test_an_unknown_model_is_404(embedder):
    r = post(embedder, "/v1/embeddings", {"model": "other", "input": "a"})
    assert r.status_code == 404 and "does not exist" in r.json()["error"]["message"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["embedder", "reranker"])
def test_the_pooling_routes_keep_to_the_schema(request, name):
    """schemathesis on the pooling routes of a pooling server: no 5xx, every answer as the schema says."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from schemathesis.checks import (content_type_conformance, not_a_server_error, response_schema_conformance,
                                     status_code_conformance)

    server = request.getfixturevalue(name)
    schema = schemathesis.openapi.from_url(server.url("/openapi.json"))
    operations = [r.ok() for r in schema.get_all_operations()]
    operations = [op for op in operations if op.path in ("/v1/embeddings", "/v1/score", "/v1/rerank")]
    assert len(operations) == 3
    for operation in operations:
        @given(case=operation.as_strategy())
        @settings(max_examples=20, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        def run(case):
            case.call_and_validate(checks=[not_a_server_error, response_schema_conformance, status_code_conformance,
                                           content_type_conformance], timeout=60)

        run()
