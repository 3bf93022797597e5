"""The KV connector interface, shaped like vLLM's KVConnectorBase_V1.

Scheduler side (the engine thread, from the scheduler, which stays the one owner of requests and
blocks): whether a request's prompt KV can come from a remote instance, starting a load into
blocks the scheduler allocated, what to do with a finished request's blocks (a producer keeps
them under a lease and answers the parameters a consumer needs), and which transfers ended since
the last step. Worker side (the engine thread, before each step): received blocks are written into
the cache by the model runner, the cache's one owner. Network work runs on the connector's own
threads; they never touch requests or the block pool.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Callable

import torch

from twostep.kv_transfer.params import RemotePrefill

# write(block_ids, parts): the model runner stores received bytes in its cache blocks
BlockWriter = Callable[[list[int], list[torch.Tensor]], None]


@dataclass(slots=True)
class TransferEvents:
    """What ended since the last poll."""

    finished_sending: list[str] = field(default_factory=list)      # producer: blocks can be freed
    finished_recving: dict[str, int] = field(default_factory=dict)  # consumer: request -> bytes written
    failed_recving: dict[str, str] = field(default_factory=dict)    # consumer: request -> why


@dataclass(slots=True)
class TransferStats:
    """Counters since start (the server's /metrics reads them)."""

    bytes_sent: int = 0
    bytes_received: int = 0
    num_loads: int = 0
    num_load_failures: int = 0
    num_leases_expired: int = 0
    load_seconds: float = 0.0

    def as_dict(self) -> dict:
        return {f"kv_transfer_{k}": getattr(self, k) for k in self.__slots__}


class KVConnector(abc.ABC):
    """One per engine; its role (producer, consumer, both) comes from the KVTransferConfig."""

    is_producer: bool
    is_consumer: bool
    failure_policy: str                 # "fail" or "recompute"

    # ---- scheduler side ----

    @abc.abstractmethod
    def start_load(self, request_id: str, remote: RemotePrefill, first_block: int,
                   local_block_ids: list[int]) -> None:
        """Pull the remote blocks from first_block on into these local blocks (in the background)."""

    @abc.abstractmethod
    def cancel_load(self, request_id: str) -> None:
        """The request ended while loading: drop what arrives for it, release the remote lease."""

    @abc.abstractmethod
    def request_finished(self, request_id: str, prompt_token_ids: list[int], block_ids: list[int]) -> dict:
        """Producer: hold these blocks for a consumer; returns the request's kv_transfer_params."""

    @abc.abstractmethod
    def expect(self, request_id: str, remote: RemotePrefill) -> None:
        """Consumer: a request that will load from remote is waiting; keep its lease alive."""

    @abc.abstractmethod
    def forget(self, request_id: str) -> None:
        """Consumer: stop keeping that request's lease alive (loading, or ended)."""

    @abc.abstractmethod
    def get_finished(self) -> TransferEvents:
        """Transfers that ended since the last call."""

    # ---- worker side ----

    @abc.abstractmethod
    def write_loaded(self, write: BlockWriter) -> None:
        """Store every load that arrived (through the model runner's writer); they are reported
        finished by the next get_finished()."""

    @abc.abstractmethod
    def wait(self, timeout: float) -> None:
        """Block until a load ends or timeout seconds pass (an engine with nothing else to do)."""

    @property
    @abc.abstractmethod
    def has_pending(self) -> bool:
        """Loads in flight or blocks held for consumers."""

    @abc.abstractmethod
    def stats(self) -> dict:
        """TransferStats.as_dict()."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop the threads; held blocks are no longer served."""
