"""What the engine hands back: vLLM-shaped RequestOutput with per-request metrics."""
from __future__ import annotations

from dataclasses import dataclass, field


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
