"""The pooling routes of a `twostep serve --runner pooling` server: POST /v1/embeddings (OpenAI's),
/v1/score (vLLM's) and /v1/rerank (also /rerank and /v2/rerank: Jina's and Cohere's shape, as vLLM and
llama.cpp serve it). Each input is one engine request that ends with its vector (engine pooling:
prefill only, batched and chunked with the others). A cross-encoder (a classifier of one label)
scores a pair as one prompt, joined as its tokenizer joins a pair (vLLM's rule); an embedding model
scores the cosine similarity of the two embeddings. A server that generates answers these routes 400,
saying how to start a pooling one (and a pooling server answers completions and chat 400:
request_checks.py)."""
from __future__ import annotations

import asyncio
import base64

import numpy as np
from fastapi import FastAPI, Request

from twostep.config import PoolingModel
from twostep.entrypoints.llm import check_cross_encoder, cosine_similarity, score_pairs
from twostep.entrypoints.openai import serving
from twostep.entrypoints.openai.errors import APIError, error_responses
from twostep.entrypoints.openai.fan_out import Batch
from twostep.entrypoints.openai.pooling_protocol import (EmbeddingRequest, EmbeddingResponse, RerankRequest,
                                                         RerankResponse, ScoreRequest, ScoreResponse)
from twostep.entrypoints.openai.request_checks import check_characters, check_fan_out, check_model, encode_prompts
from twostep.entrypoints.openai.state import ServerState
from twostep.outputs import PoolingRequestOutput
from twostep.pooling_params import PoolingParams

_ERRORS = error_responses(400, 404, 413, 500, 503)
RERANK_PATHS = ("/v1/rerank", "/rerank", "/v2/rerank")


def add_pooling_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/embeddings", response_model=None, responses={200: {"model": EmbeddingResponse}, **_ERRORS})
    async def embeddings(body: EmbeddingRequest, raw: Request):
        return await create_embeddings(state, body, raw)

    @app.post("/v1/score", response_model=None, responses={200: {"model": ScoreResponse}, **_ERRORS})
    async def score(body: ScoreRequest, raw: Request):
        return await create_score(state, body, raw)

    async def rerank(body: RerankRequest, raw: Request):
        return await create_rerank(state, body, raw)

    for path in RERANK_PATHS:
        app.add_api_route(path, rerank, methods=["POST"], response_model=None,
                          operation_id=f"rerank{path.replace('/', '_')}",
                          responses={200: {"model": RerankResponse}, **_ERRORS})


# ---- /v1/embeddings ----------------------------------------------------------------------------

async def create_embeddings(state: ServerState, body: EmbeddingRequest, raw: Request) -> dict:
    check_model(state, body.model)
    pooling = _pooling_model(state, "/v1/embeddings")
    if pooling.task != "embed":
        raise APIError(400, "this model classifies (a cross-encoder): it serves /v1/score and /v1/rerank, not "
                            "/v1/embeddings; serve an embedding model for embeddings", "model")
    inputs = body.inputs()
    if not inputs or any(not p for p in inputs):
        raise APIError(400, "input is empty: give at least one non-empty text or list of token ids", "input")
    check_fan_out(state, len(inputs), 1)
    try:
        pooling.check_dimensions(body.dimensions)
    except ValueError as e:
        raise APIError(400, str(e), "dimensions") from None
    ids = [body.truncate(p) for p in await _encode(state, pooling, inputs, body.add_special_tokens)]
    _check_lengths(state, ids, "input")
    params = PoolingParams(task="embed", dimensions=body.dimensions, normalize=body.normalize)
    batch, outs = await _run(state, "embd", body, ids, params, raw)
    data = [{"object": "embedding", "index": i, "embedding": _encoded(o, body.encoding_format)}
            for i, o in enumerate(outs)]
    return {"id": batch.id, "object": "list", "created": serving.now(), "model": state.model_name, "data": data,
            "usage": _usage(sum(len(o.prompt_token_ids) for o in outs))}


def _encoded(out: PoolingRequestOutput, encoding_format: str) -> list[float] | str:
    vector = out.outputs.data
    if encoding_format == "base64":      # little-endian float32, as OpenAI's SDKs decode it
        return base64.b64encode(vector.numpy().astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


# ---- /v1/score and /v1/rerank ------------------------------------------------------------------

async def create_score(state: ServerState, body: ScoreRequest, raw: Request) -> dict:
    check_model(state, body.model)
    pooling = _pooling_model(state, "/v1/score")
    try:
        pairs = score_pairs(body.text_1, body.text_2)
    except ValueError as e:
        raise APIError(400, str(e), "text_2" if "text_2" in str(e) else "text_1") from None
    batch, scores, tokens = await _scores(state, pooling, pairs, body, raw, "score")
    data = [{"object": "score", "index": i, "score": s} for i, s in enumerate(scores)]
    return {"id": batch.id, "object": "list", "created": serving.now(), "model": state.model_name, "data": data,
            "usage": _usage(tokens)}


async def create_rerank(state: ServerState, body: RerankRequest, raw: Request) -> dict:
    check_model(state, body.model)
    pooling = _pooling_model(state, "/v1/rerank")
    if not body.query:
        raise APIError(400, "query is empty", "query")
    if not body.documents or any(not d for d in body.documents):
        raise APIError(400, "documents is empty, or one of them is: give at least one non-empty document",
                       "documents")
    pairs = [(body.query, d) for d in body.documents]
    batch, scores, tokens = await _scores(state, pooling, pairs, body, raw, "rerank")
    ranked = sorted(range(len(scores)), key=lambda i: -scores[i])[:body.top_n or None]
    results = [{"index": i, "relevance_score": scores[i],
                **({"document": {"text": body.documents[i]}} if body.return_documents else {})} for i in ranked]
    return {"id": batch.id, "model": state.model_name, "usage": _usage(tokens), "results": results}


async def _scores(state: ServerState, pooling: PoolingModel, pairs: list[tuple[str, str]],
                  body: ScoreRequest | RerankRequest, raw: Request, prefix: str) -> tuple[Batch, list[float], int]:
    """Each pair's score and the prompt tokens it took: a cross-encoder's on the pair as one prompt, an
    embedding model's cosine similarity of the two texts' embeddings (each text embedded once)."""
    for a, b in pairs:
        check_characters(state, len(a) + len(b), "text")
    if pooling.task == "classify":
        try:
            check_cross_encoder(pooling)
        except ValueError as e:
            raise APIError(400, str(e), "model") from None
        check_fan_out(state, len(pairs), 1)
        tok = state.tokenizer
        ids = [body.truncate(p) for p in await asyncio.to_thread(lambda: [tok.encode_pair(a, b) for a, b in pairs])]
        _check_lengths(state, ids, "text")
        batch, outs = await _run(state, prefix, body, ids, PoolingParams(task="classify", activation=body.activation),
                                 raw)
        return batch, [float(o.outputs.data[0]) for o in outs], sum(len(o.prompt_token_ids) for o in outs)
    texts = list(dict.fromkeys(t for pair in pairs for t in pair))
    check_fan_out(state, len(texts), 1)
    ids = [body.truncate(p) for p in await _encode(state, pooling, texts)]
    _check_lengths(state, ids, "text")
    batch, outs = await _run(state, prefix, body, ids, PoolingParams(task="embed"), raw)
    vectors = {t: o.outputs.data for t, o in zip(texts, outs)}
    return (batch, [cosine_similarity(vectors[a], vectors[b]) for a, b in pairs],
            sum(len(o.prompt_token_ids) for o in outs))


# ---- shared ------------------------------------------------------------------------------------

def _pooling_model(state: ServerState, route: str) -> PoolingModel:
    pooling = state.engine.engine.pooling
    if pooling is None:
        raise APIError(400, f"this server generates (--runner generate): {route} needs a pooling model; start one "
                            "with `twostep serve MODEL --runner pooling` (an embedding model such as "
                            "Qwen3-Embedding, or a cross-encoder: a *ForSequenceClassification checkpoint)", "model")
    return pooling


async def _encode(state: ServerState, pooling: PoolingModel, prompts: list[str | list[int]],
                  add_special_tokens: bool = True) -> list[list[int]]:
    """Every prompt's token ids, texts as the model reads them (a chat message, for a sentence-transformers
    folder that says so), tokenized in a worker thread."""
    if not pooling.texts_as_messages:
        return await encode_prompts(state, prompts, add_special_tokens)
    for p in prompts:
        if isinstance(p, str):
            check_characters(state, len(p), "input")
    tok = state.tokenizer
    return await asyncio.to_thread(lambda: [pooling.encode_text(tok, p) if isinstance(p, str) else list(p)
                                            for p in prompts])


def _check_lengths(state: ServerState, ids: list[list[int]], field: str) -> None:
    """A pooling prompt may fill max_model_len (it generates nothing)."""
    limit = state.engine.engine.max_model_len
    for i, p in enumerate(ids):
        if len(p) > limit:
            raise APIError(400, f"{field} {i} has {len(p)} tokens; max_model_len is {limit} (truncate_prompt_tokens "
                                "keeps the last k)", field)


async def _run(state: ServerState, prefix: str, body, ids: list[list[int]], params: PoolingParams,
               raw: Request) -> tuple[Batch, list[PoolingRequestOutput]]:
    """Every prompt as an engine request, their outputs in input order; a client that leaves aborts them."""
    batch = Batch(state, prefix, body.request_id)
    await batch.add(ids, params, body.priority)
    outs: list[PoolingRequestOutput | None] = [None] * len(ids)
    async for i, out in batch.outputs(raw):
        if out.finished:
            outs[i] = out
    if any(o is None for o in outs):
        raise APIError(499, "client disconnected")
    ended = next((o for o in outs if o.outputs is None), None)
    if ended is not None:
        raise APIError(500, f"request {ended.request_id} ended without its vector ({ended.finish_reason}"
                            f"{'' if ended.stop_reason is None else f': {ended.stop_reason}'})")
    return batch, outs


def _usage(tokens: int) -> dict:
    return {"prompt_tokens": tokens, "total_tokens": tokens}
