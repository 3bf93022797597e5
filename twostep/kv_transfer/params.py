"""kv_transfer_params, the dict a request carries between instances (vLLM's name and keys).

To the producer (prefill instance) the proxy sends {"do_remote_decode": true}; its answer carries
where the blocks are: {"do_remote_prefill": true, "remote_engine_id", "remote_host", "remote_port",
"remote_request_id", "remote_block_ids", "num_prompt_tokens", "prompt_hash", "lease_s"}, which the proxy
passes to the consumer (decode instance) unchanged. prompt_hash lets the consumer check that the
blocks belong to the very prompt it tokenized.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

_REMOTE_KEYS = {"remote_engine_id": str, "remote_host": str, "remote_port": int, "remote_request_id": str,
                "remote_block_ids": list, "num_prompt_tokens": int, "prompt_hash": str}


def prompt_hash(token_ids: list[int]) -> str:
    return hashlib.sha256(b",".join(str(t).encode() for t in token_ids)).hexdigest()[:32]


@dataclass(slots=True, frozen=True)
class RemotePrefill:
    """Where a consumer's request finds its prompt's KV blocks."""

    engine_id: str
    host: str
    port: int
    request_id: str             # the producer's request (its lease)
    block_ids: tuple[int, ...]  # the producer's blocks, in prompt order
    num_prompt_tokens: int
    prompt_hash: str
    lease_s: float = 30.0       # the producer's lease: a waiting consumer extends it well before

    @property
    def address(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    @classmethod
    def parse(cls, params: dict) -> "RemotePrefill":
        missing = [k for k in _REMOTE_KEYS if k not in params]
        if missing:
            raise ValueError(f"kv_transfer_params with do_remote_prefill need {', '.join(missing)}")
        for key, kind in _REMOTE_KEYS.items():
            if not isinstance(params[key], kind) or isinstance(params[key], bool):
                raise ValueError(f"kv_transfer_params {key} must be a {kind.__name__}, got {params[key]!r}")
        if not 0 < params["remote_port"] < 65536:
            raise ValueError(f"kv_transfer_params remote_port must be a port number, got {params['remote_port']}")
        if not re.fullmatch(r"[A-Za-z0-9.\-:\[\]]+", params["remote_host"]):
            raise ValueError(f"kv_transfer_params remote_host {params['remote_host']!r} is not a host name or address")
        blocks = params["remote_block_ids"]
        if not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in blocks):
            raise ValueError("kv_transfer_params remote_block_ids must be positive block ids")
        lease = params.get("lease_s", 30.0)
        if not isinstance(lease, (int, float)) or isinstance(lease, bool) or lease <= 0:
            raise ValueError(f"kv_transfer_params lease_s must be a positive number, got {lease!r}")
        return cls(params["remote_engine_id"], params["remote_host"], params["remote_port"],
                   params["remote_request_id"], tuple(blocks), params["num_prompt_tokens"],
                   params["prompt_hash"], float(lease))

    def check_prompt(self, token_ids: list[int], block_size: int) -> None:
        """The blocks must be this prompt's, and cover it."""
        if self.num_prompt_tokens != len(token_ids) or self.prompt_hash != prompt_hash(token_ids):
            raise ValueError(f"kv_transfer_params are for another prompt ({self.num_prompt_tokens} tokens, "
                             f"hash {self.prompt_hash}) than this request's ({len(token_ids)} tokens, hash "
                             f"{prompt_hash(token_ids)}): prefill and decode instances must serve the same "
                             "model and tokenizer")
        if len(self.block_ids) != -(-len(token_ids) // block_size):
            raise ValueError(f"kv_transfer_params name {len(self.block_ids)} blocks for {len(token_ids)} "
                             f"prompt tokens at block size {block_size}")


def producer_params(engine_id: str, host: str, port: int, request_id: str, block_ids: list[int],
                    prompt_token_ids: list[int], lease_s: float) -> dict:
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": engine_id,
            "remote_host": host, "remote_port": port, "remote_request_id": request_id,
            "remote_block_ids": list(block_ids), "num_prompt_tokens": len(prompt_token_ids),
            "prompt_hash": prompt_hash(prompt_token_ids), "lease_s": lease_s}
