"""A rank's share of a tensor-parallel model, Megatron's split as nano-vllm and vLLM do it: q/k/v
and gate/up split by output (heads, intermediate features), o_proj and down_proj by input with one
all-reduce each, the embedding and lm_head by vocabulary (a lookup is summed over ranks; logits are
gathered). KV heads split across ranks, or each rank keeps the one its query heads use when there are
fewer KV heads than ranks.

world_size 1 is the plain model: every collective is the identity and no process group exists.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(slots=True, frozen=True)
class TensorParallel:
    rank: int = 0
    world_size: int = 1

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    def split(self, n: int, what: str) -> tuple[int, int]:
        """This rank's [start, end) of n items split evenly."""
        if n % self.world_size:
            raise ValueError(f"tensor_parallel_size {self.world_size} does not divide the model's {n} {what}")
        size = n // self.world_size
        return self.rank * size, (self.rank + 1) * size

    def kv_heads(self, num_heads: int, num_kv_heads: int) -> tuple[int, int]:
        """This rank's [start, end) of KV heads: its share, or the single one its query heads
        read when the heads are fewer than the ranks (replicated)."""
        if num_kv_heads >= self.world_size:
            return self.split(num_kv_heads, "KV heads")
        if self.world_size % num_kv_heads:
            raise ValueError(f"tensor_parallel_size {self.world_size} is not a multiple of the model's "
                             f"{num_kv_heads} KV heads")
        q_start, _ = self.split(num_heads, "attention heads")
        head = q_start // (num_heads // num_kv_heads)
        return head, head + 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks (row-parallel outputs, vocab-parallel lookups), in place."""
        if self.enabled:
            dist.all_reduce(x)
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's slice side by side along the last dimension (vocab-parallel logits)."""
        if not self.enabled:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)

    def embed(self, embedding, ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """A vocab-parallel lookup: each rank looks up the ids in its slice, zeros elsewhere, summed."""
        if not self.enabled:
            return embedding(ids)
        start, end = self.split(vocab_size, "vocabulary entries")
        outside = (ids < start) | (ids >= end)
        x = embedding((ids - start).masked_fill(outside, 0))
        x.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.all_reduce(x)
