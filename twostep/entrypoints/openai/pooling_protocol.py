"""The pooling routes' request and response bodies (pooling.py): OpenAI's embeddings, vLLM's score, and
rerank in the Jina / Cohere shape vLLM and llama.cpp serve. Requests are strict (types, and no field
the route does not know: each one here changes the result or is OpenAI's own); responses are what the
handlers build, so the OpenAPI schema says what each route returns."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class _PoolingRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    user: str | None = None
    # vLLM's request extras
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)   # keep each prompt's last k tokens
    request_id: str | None = Field(default=None, min_length=1, max_length=128)
    priority: int = 0

    def truncate(self, ids: list[int]) -> list[int]:
        k = self.truncate_prompt_tokens
        return ids[-k:] if k is not None and len(ids) > k else ids


class EmbeddingRequest(_PoolingRequest):
    """OpenAI's: input is a text, texts, token ids, or lists of token ids (one embedding each)."""

    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"   # base64: little-endian float32, as OpenAI's SDK reads it
    dimensions: int | None = None                            # Matryoshka models only: the first d values
    # vLLM's extras
    add_special_tokens: bool = True
    normalize: bool | None = None                            # unit length (default: the model's)

    def inputs(self) -> list[str | list[int]]:
        if isinstance(self.input, str):
            return [self.input]
        if self.input and isinstance(self.input[0], int):
            return [list(self.input)]
        return list(self.input)


class ScoreRequest(_PoolingRequest):
    """vLLM's: text_1 against each of text_2 (one text_1), or the two lists pair by pair."""

    text_1: str | list[str]
    text_2: str | list[str]
    activation: bool | None = None       # a cross-encoder's sigmoid (default on); false: its raw logit


class RerankRequest(_PoolingRequest):
    """Jina's and Cohere's (as vLLM and llama.cpp serve them): the documents ranked by their relevance
    to the query, the top_n best (0 or none: all)."""

    query: str
    documents: list[str]
    top_n: int | None = Field(default=None, ge=0)
    return_documents: bool = True
    activation: bool | None = None


class PoolingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str         # a string with encoding_format base64


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[EmbeddingData]
    usage: PoolingUsage


class ScoreData(BaseModel):
    object: Literal["score"] = "score"
    index: int
    score: float


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ScoreData]
    usage: PoolingUsage


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int                           # the document's place in the request's documents
    relevance_score: float
    document: RerankDocument | None = None   # with return_documents


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: PoolingUsage
    results: list[RerankResult]          # best first
