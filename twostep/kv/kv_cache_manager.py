"""Per-request block tables on top of the block pool.

The scheduler asks for room for `num_new_tokens` more tokens of a request (a prefill
chunk, one decode token, or k+1 tokens of a speculative verification step); the manager
grows the request's block table to cover them, or says no without side effects.
"""
from __future__ import annotations

from twostep.kv.block_pool import BlockPool, KVBlock


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self._blocks: dict[str, list[KVBlock]] = {}

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_ever_fit(self, num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) <= self.pool.num_blocks

    def allocate_slots(self, request_id: str, num_computed_tokens: int,
                       num_new_tokens: int) -> bool:
        """Make the request's table cover num_computed_tokens + num_new_tokens positions."""
        blocks = self._blocks.setdefault(request_id, [])
        extra = self.blocks_needed(num_computed_tokens + num_new_tokens) - len(blocks)
        if extra <= 0:
            return True
        if extra > self.pool.num_free_blocks:
            return False
        blocks.extend(self.pool.allocate(extra))
        return True

    def free(self, request_id: str) -> None:
        blocks = self._blocks.pop(request_id, [])
        self.pool.free(list(reversed(blocks)))

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._blocks.get(request_id, [])]

    def num_blocks_of(self, request_id: str) -> int:
        return len(self._blocks.get(request_id, []))

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.num_used_blocks / self.pool.num_blocks

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        held: dict[int, int] = {}
        for blocks in self._blocks.values():
            for b in blocks:
                held[b.block_id] = held.get(b.block_id, 0) + 1
        for b in self.pool.blocks:
            assert held.get(b.block_id, 0) == b.ref_cnt, (
                f"block {b.block_id}: ref_cnt {b.ref_cnt} but held by {held.get(b.block_id, 0)} tables")
