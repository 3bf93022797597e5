"""One KV-cache group's block tables: the layers that share an attention span (full attention, or
one sliding window) and the pool of blocks their K/V live in. kv/kv_cache_manager.py holds one
group per span and keeps them in step.

A table has a block per position block. In a sliding-window group, a block whose positions no
later query can see is released after the step that passed it (release_out_of_window), so a
sequence holds at most the window's blocks plus the one being filled, however long it grows. Its
place in the table becomes the null block (table()), so positions keep their index; the block
stays in the prefix cache until evicted, and a later hit needs only the blocks its next query
sees (vLLM's sliding-window manager): the leading ones may be gone.
"""
from __future__ import annotations

from typing import Sequence

from twostep.kv.block_hash import BlockKey
from twostep.kv.block_pool import NULL_BLOCK_ID, BlockPool, KVBlock


class BlockTables:
    def __init__(self, num_blocks: int, block_size: int, window: int | None = None) -> None:
        """window: the sliding window of every layer in the group (None: full attention)."""
        self.block_size = block_size
        self.window = window
        self.pool = BlockPool(num_blocks)
        self._blocks: dict[str, list[KVBlock]] = {}
        self._released: dict[str, int] = {}         # leading blocks released out of the window
        self._num_registered: dict[str, int] = {}   # leading blocks already offered to the cache

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def first_needed(self, position: int) -> int:
        """The first block a query at `position` sees (every block without a window)."""
        return 0 if self.window is None else max(0, position - self.window + 1) // self.block_size

    def sequence_blocks(self, num_tokens: int, chunk: int) -> int:
        """The most blocks one sequence of num_tokens tokens holds at once, prefilled `chunk`
        tokens a step: all of them, or a window's and a chunk's (and the one the window starts in)."""
        if self.window is None:
            return self.blocks_needed(num_tokens)
        return min(self.blocks_needed(num_tokens), self.blocks_needed(self.window + chunk) + 1)

    def lookup(self, keys: Sequence[BlockKey]) -> list[KVBlock | None]:
        return [self.pool.lookup(key) for key in keys]

    def hit_covers(self, cached: Sequence[KVBlock | None], n: int) -> bool:
        """Whether the first n cached blocks serve a hit of n blocks: those its next query sees."""
        return all(b is not None for b in cached[self.first_needed(n * self.block_size):n])

    def hit_blocks(self, cached: Sequence[KVBlock | None], n: int) -> list[KVBlock | None]:
        """A hit of n blocks: None for the leading ones out of the window."""
        first = self.first_needed(n * self.block_size)
        return [None] * first + list(cached[first:n])

    def shortfall(self, request_id: str, num_tokens: int, computed_blocks: Sequence[KVBlock | None] = ()) -> int:
        """How many blocks the pool lacks to cover num_tokens positions (0: it has them)."""
        blocks = self._blocks.get(request_id, ())
        have = self._released.get(request_id, 0) + len(computed_blocks) + len(blocks)
        # Evictable hits sit in the free queue: reviving them makes them unavailable.
        revived = sum(b is not None and b.ref_cnt == 0 for b in computed_blocks)
        return max(0, self.blocks_needed(num_tokens) - have - (self.pool.num_free_blocks - revived))

    def allocate(self, request_id: str, num_tokens: int, computed_blocks: Sequence[KVBlock | None] = ()) -> None:
        """Cover num_tokens positions, starting from computed_blocks (prefix-cache hits; None: a
        block out of the window) for a request with no table yet; shortfall() said it fits."""
        blocks = self._blocks.setdefault(request_id, [])
        if computed_blocks:
            assert not blocks, "prefix hits are only taken before a request's first chunk"
            hits = [b for b in computed_blocks if b is not None]
            self.pool.touch(hits)
            blocks.extend(hits)
            if len(hits) < len(computed_blocks):
                self._released[request_id] = len(computed_blocks) - len(hits)
        extra = self.blocks_needed(num_tokens) - self._released.get(request_id, 0) - len(blocks)
        if extra > 0:
            blocks.extend(self.pool.allocate(extra))
        self._num_registered.setdefault(request_id, 0)

    def cache_full_blocks(self, request_id: str, keys: Sequence[BlockKey], full: int) -> None:
        """Offer the first `full` blocks (full and computed; keys: theirs) to the prefix cache."""
        blocks = self._blocks.get(request_id)
        if not blocks:
            return
        released = self._released.get(request_id, 0)
        full = min(full, released + len(blocks))
        start = self._num_registered.get(request_id, 0)
        for i in range(max(start, released), full):
            self.pool.cache(blocks[i - released], keys[i])
        self._num_registered[request_id] = max(start, full)

    def num_registered(self, request_id: str) -> int:
        return self._num_registered.get(request_id, 0)

    def release_out_of_window(self, request_id: str, num_computed_tokens: int) -> int:
        """Release the leading blocks no query from position num_computed_tokens on can see (a
        query at p sees p - window < k <= p); how many. Nothing without a window."""
        blocks = self._blocks.get(request_id)
        if self.window is None or not blocks:
            return 0
        released = self._released.get(request_id, 0)
        n = min(self.first_needed(num_computed_tokens) - released, len(blocks) - 1)
        if n <= 0:
            return 0
        self.pool.free(blocks[:n])
        del blocks[:n]
        self._released[request_id] = released + n
        return n

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Release the blocks past the first num_tokens positions (rejected draft tokens'
        slots, rolled back after verification), tail first. Registered blocks never lie past
        a request's computed tokens, so only uncached blocks are released."""
        blocks = self._blocks.get(request_id)
        if not blocks:
            return
        released = self._released.get(request_id, 0)
        keep = self.blocks_needed(num_tokens) - released
        assert keep + released >= self._num_registered.get(request_id, 0), "trim would drop a cached block"
        if keep < len(blocks):
            self.pool.free(list(reversed(blocks[keep:])))
            del blocks[keep:]

    def free(self, request_id: str) -> None:
        """Release the request's blocks, tail first: a suffix is evicted before its prefix."""
        blocks = self._blocks.pop(request_id, [])
        self._released.pop(request_id, None)
        self._num_registered.pop(request_id, None)
        self.pool.free(list(reversed(blocks)))

    def table(self, request_id: str) -> list[int]:
        """The request's table: a block per position block, the null block where one was released."""
        return [NULL_BLOCK_ID] * self._released.get(request_id, 0) + [b.block_id for b in self._blocks.get(request_id, [])]

    def table_length(self, request_id: str) -> int:
        return self._released.get(request_id, 0) + len(self._blocks.get(request_id, []))

    def num_blocks_of(self, request_id: str) -> int:
        """Blocks the request holds."""
        return len(self._blocks.get(request_id, []))

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        held: dict[int, int] = {}
        for blocks in self._blocks.values():
            for b in blocks:
                held[b.block_id] = held.get(b.block_id, 0) + 1
        for b in self.pool.blocks:
            assert held.get(b.block_id, 0) == b.ref_cnt, (
                f"block {b.block_id}: ref_cnt {b.ref_cnt} but held by {held.get(b.block_id, 0)} tables")
