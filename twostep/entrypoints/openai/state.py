"""The server's settings (ServerConfig: `twostep serve`'s own flags) and what every route reads
(ServerState: the AsyncEngine, the model's name, the metrics).
"""
from __future__ import annotations

from dataclasses import dataclass

from twostep.entrypoints.async_engine import AsyncEngine
from twostep.entrypoints.openai.metrics import ServerMetrics
from twostep.entrypoints.openai.tool_parsers import TOOL_PARSERS, get_tool_parser
from twostep.entrypoints.reasoning import get_reasoning_parser

DEFAULT_MAX_BODY_BYTES = 4 << 20
# A default server queues this many sequences per one it runs (--max-num-seqs) and answers 503 with
# Retry-After past that, as a server behind a load balancer should: never an unbounded queue that one
# request (prompts x n) can fill.
QUEUED_PER_RUNNING = 4


@dataclass(slots=True)
class ServerConfig:
    """`twostep serve`'s own settings (the engine's are EngineConfig)."""

    model_name: str
    chat_template: str | None = None             # --chat-template: instead of the model's
    max_queued_requests: int | None = None        # None: QUEUED_PER_RUNNING x the engine's max_num_seqs
    request_timeout: float | None = None
    api_key: str | None = None
    metrics_need_key: bool = False               # /metrics behind the API key too
    max_request_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    trust_request_chat_template: bool = False    # chat_template_kwargs may carry a template
    model_aliases: tuple[str, ...] = ()          # other names requests may use (--model as given)
    enable_tokenizer_info_endpoint: bool = False  # GET /tokenizer_info (it shows the chat template)
    enable_auto_tool_choice: bool = False        # tool_choice "auto": parse calls out of the output
    tool_call_parser: str | None = None          # --tool-call-parser: one of tool_parsers.TOOL_PARSERS
    reasoning_parser: str | None = None          # --reasoning-parser: deepseek_r1, qwen3, think, gpt_oss
    structured_outputs_in_reasoning: bool = False  # constraints cover the thinking too, not only the answer
    max_stored_responses: int = 1000             # Responses API: stored responses kept (least recently used go)

    def __post_init__(self) -> None:
        if self.max_stored_responses < 0:
            raise ValueError(f"--max-stored-responses must be >= 0; got {self.max_stored_responses}")
        if self.max_queued_requests is not None and self.max_queued_requests < 1:
            raise ValueError(f"--max-queued-requests must be at least 1; got {self.max_queued_requests}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser "
                             f"({', '.join(sorted(TOOL_PARSERS))})")
        if self.tool_call_parser is not None:
            get_tool_parser(self.tool_call_parser)    # an unknown name fails at start-up
        if self.reasoning_parser is not None:
            get_reasoning_parser(self.reasoning_parser)

    @property
    def auto_tool_parser(self) -> str | None:
        return self.tool_call_parser if self.enable_auto_tool_choice else None


@dataclass
class ServerState:
    engine: AsyncEngine
    model_name: str
    metrics: ServerMetrics
    config: ServerConfig

    @property
    def tokenizer(self):
        return self.engine.engine.tokenizer
