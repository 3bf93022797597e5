"""What the engine hands back: vLLM-shaped RequestOutput with per-request metrics; a pooling request's
PoolingRequestOutput and the embedding, classification and score outputs made from it."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(slots=True)
class SpecDecodeStats:
    """Speculative decoding counters, as vLLM reports them: drafts (verification rounds), draft
    tokens, accepted tokens, and acceptances per draft position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_draft_tokens:
            self.accepted_per_position += [0] * (num_draft_tokens - len(self.accepted_per_position))
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verification round: accepted drafts plus the target's own token."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def as_dict(self) -> dict:
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "acceptance_rate": self.acceptance_rate,
                "mean_acceptance_length": self.mean_acceptance_length,
                "accepted_per_position": list(self.accepted_per_position)}


# One position's logprobs: token id -> (logprob, rank, decoded token).
@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PositionLogprobs = dict[int, Logprob]


@dataclass(slots=True)
class RequestMetrics:
    """Real timestamps (time.monotonic seconds) and the latencies derived from them."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    num_kv_blocks: int = 0          # most KV blocks the request held at once
    # Prefill/decode disaggregation (a consumer): the prompt KV loaded from a remote instance
    kv_load_start_time: float | None = None
    kv_load_end_time: float | None = None
    num_remote_tokens: int = 0      # prompt tokens whose KV was loaded, not computed here
    kv_transfer_bytes: int = 0
    spec_decode: SpecDecodeStats | None = None   # drafts and acceptances, with speculation on

    @property
    def ttft(self) -> float | None:
        """Time to first token: arrival -> first sampled token (queueing + prefill)."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def inter_token_latencies(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot(self) -> float | None:
        """Time per output token: mean over decode steps (tokens after the first)."""
        itl = self.inter_token_latencies
        return sum(itl) / len(itl) if itl else None

    @property
    def e2e_latency(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time

    # vLLM v1's names for the same figures (RequestStateStats)
    @property
    def queued_ts(self) -> float:
        return self.arrival_time

    @property
    def scheduled_ts(self) -> float | None:
        return self.first_scheduled_time

    @property
    def first_token_ts(self) -> float | None:
        return self.first_token_time

    @property
    def last_token_ts(self) -> float | None:
        return self.last_token_time

    @property
    def first_token_latency(self) -> float | None:
        return self.ttft

    @property
    def num_generation_tokens(self) -> int:
        return self.num_generated_tokens


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None     # "stop", "length", "abort"
    stop_reason: int | str | None = None  # the stop string or token id that ended it
    # What is new since the previous output of this request (for streaming).
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    kv_transfer_params: dict | None = None   # a producer's finished prefill: where its KV blocks wait


# ---- pooling requests (embeddings, classification, scores): one vector each, no tokens --------------

@dataclass(slots=True)
class PoolingOutput:
    """A pooling request's vector (vLLM's): an embedding, or a classifier's probabilities (or logits
    with activation off); float32, on the CPU."""

    data: "torch.Tensor"


@dataclass(slots=True)
class PoolingRequestOutput:
    """A pooling request's one output (vLLM's): it comes when the prompt has run through the model.
    outputs is None only when the request ended without a vector (aborted, timed out)."""

    request_id: str
    outputs: PoolingOutput | None
    prompt_token_ids: list[int]
    finished: bool
    metrics: RequestMetrics
    prompt: str | None = None
    num_cached_tokens: int = 0
    finish_reason: str | None = None         # "stop" with a vector, else why it ended ("abort", "length")
    stop_reason: int | str | None = None


@dataclass(slots=True)
class EmbeddingOutput:
    embedding: list[float]

    @classmethod
    def from_base(cls, output: PoolingOutput) -> "EmbeddingOutput":
        return cls(output.data.tolist())

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass(slots=True)
class ClassificationOutput:
    probs: list[float]                       # per label (raw logits with activation off)

    @classmethod
    def from_base(cls, output: PoolingOutput) -> "ClassificationOutput":
        return cls(output.data.tolist())

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass(slots=True)
class ScoringOutput:
    score: float                             # a cross-encoder's probability (or logit), or a cosine similarity


@dataclass(slots=True)
class EmbeddingRequestOutput:
    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True

    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> "EmbeddingRequestOutput":
        return cls(out.request_id, EmbeddingOutput.from_base(out.outputs), out.prompt_token_ids, out.finished)


@dataclass(slots=True)
class ClassificationRequestOutput:
    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    finished: bool = True

    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> "ClassificationRequestOutput":
        return cls(out.request_id, ClassificationOutput.from_base(out.outputs), out.prompt_token_ids, out.finished)


@dataclass(slots=True)
class ScoringRequestOutput:
    """One (text_1, text_2) pair's score; prompt_token_ids: the pair's prompt (a cross-encoder's) or
    both texts' tokens one after the other (an embedding model's)."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True
