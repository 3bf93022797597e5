"""Per-request block tables on top of the block pool, with automatic prefix caching.

The scheduler asks for room for `num_new_tokens` more tokens of a request (a prefill
chunk, one decode token, or k+1 tokens of a speculative verification step); the manager
grows the request's block table to cover them, or says no without side effects.

Prefix caching: before a request's first chunk, get_computed_blocks() walks its full
blocks through the cache by chained key and returns the leading hits (never all of the
tokens: the last one is always computed, so its logits exist). After every step,
cache_full_blocks() registers the blocks that became full and computed, prompt and
generated tokens alike, so the next turn of a chat hits them too.

Sliding window: where every layer attends within the same window (Mistral, Phi-3 with a window),
a block whose positions no later query can see is released after the step that passed it
(release_out_of_window), so a sequence holds at most the window's blocks plus the one being
filled, however long it grows. Its place in the table becomes the null block (block_ids), so
positions keep their index; the block stays in the prefix cache until evicted, and a later hit
needs only the blocks its next query sees (vLLM's sliding-window manager): the leading ones may
be gone.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Sequence

from twostep.kv.block_hash import BlockKey, chain_keys
from twostep.kv.block_pool import NULL_BLOCK_ID, BlockPool, KVBlock


@dataclass(slots=True)
class PrefixCacheStats:
    queries: int = 0     # tokens looked up
    hits: int = 0        # tokens served from cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 window: int | None = None) -> None:
        """window: every layer's sliding window (None: full attention, or layers that differ)."""
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.window = window
        self._released: dict[str, int] = {}         # leading blocks released out of the window
        self.pool = BlockPool(num_blocks)
        self.prefix_stats = PrefixCacheStats()
        self._blocks: dict[str, list[KVBlock]] = {}
        self._keys: dict[str, list[BlockKey]] = {}
        self._num_registered: dict[str, int] = {}   # leading blocks already offered to the cache

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def sequence_capacity(self, chunk: int) -> int:
        """The longest sequence the whole cache holds, prefilled `chunk` tokens a step: the cache's
        tokens, or any length where a window's blocks and a chunk's fit (they are all it holds)."""
        if self.window is not None and self.blocks_needed(self.window + chunk) + 1 <= self.pool.num_blocks:
            return 1 << 62
        return self.pool.num_blocks * self.block_size

    def can_ever_fit(self, num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) <= self.pool.num_blocks

    def get_computed_blocks(self, request_id: str, token_ids: Sequence[int],
                            extra: Hashable = None) -> tuple[list[KVBlock | None], int]:
        """Leading cached blocks of these tokens and how many tokens they cover. Takes no
        reference (pass them to allocate_slots, which does) and counts nothing (record_lookup).
        With a window, a hit needs only the blocks the next query sees: those before are None."""
        if not self.enable_prefix_caching:
            return [], 0
        keys = chain_keys(token_ids, self.block_size, self._keys.get(request_id, []), extra)
        self._keys[request_id] = keys
        # Cap at len - 1 tokens: the last token must run through the model for its logits.
        usable = (len(token_ids) - 1) // self.block_size
        cached = [self.pool.lookup(key) for key in keys[:usable]]
        if self.window is None:
            n = next((i for i, b in enumerate(cached) if b is None), usable)
            return cached[:n], n * self.block_size
        for n in range(usable, 0, -1):          # the longest hit whose window's blocks are all cached
            first = self._first_needed(n * self.block_size)
            if all(b is not None for b in cached[first:n]):
                return [None] * first + cached[first:n], n * self.block_size
        return [], 0

    def _first_needed(self, position: int) -> int:
        """The first block a query at `position` sees (every block without a window)."""
        return 0 if self.window is None else max(0, position - self.window + 1) // self.block_size

    def record_lookup(self, num_tokens: int, num_hit: int) -> None:
        """Count one prefix-cache lookup that was used (the request got its blocks); lookups of
        a request that must keep waiting are repeated later and not counted twice."""
        if self.enable_prefix_caching:
            self.prefix_stats.queries += num_tokens
            self.prefix_stats.hits += num_hit

    def allocate_slots(self, request_id: str, num_computed_tokens: int, num_new_tokens: int,
                       computed_blocks: Sequence[KVBlock | None] = ()) -> bool:
        """Make the request's table cover num_computed_tokens + num_new_tokens positions,
        starting from computed_blocks (prefix-cache hits; None: a block out of the window) for a
        request with no table yet."""
        blocks = self._blocks.setdefault(request_id, [])
        if computed_blocks:
            assert not blocks, "prefix hits are only taken before a request's first chunk"
        skipped = sum(b is None for b in computed_blocks)
        computed_blocks = [b for b in computed_blocks if b is not None]
        have = self._released.get(request_id, 0) + skipped + len(blocks) + len(computed_blocks)
        extra = self.blocks_needed(num_computed_tokens + num_new_tokens) - have
        # Evictable hits sit in the free queue: reviving them makes them unavailable.
        revived = sum(b.ref_cnt == 0 for b in computed_blocks)
        if extra > self.pool.num_free_blocks - revived:
            if not blocks:
                del self._blocks[request_id]
            return False
        self.pool.touch(computed_blocks)
        blocks.extend(computed_blocks)
        if skipped:
            self._released[request_id] = skipped
        if extra > 0:
            blocks.extend(self.pool.allocate(extra))
        self._num_registered.setdefault(request_id, 0)
        return True

    def cache_full_blocks(self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int,
                          extra: Hashable = None) -> None:
        """Offer every block that is now full and computed to the prefix cache."""
        if not self.enable_prefix_caching:
            return
        blocks = self._blocks.get(request_id)
        if not blocks:
            return
        released = self._released.get(request_id, 0)
        full = min(num_computed_tokens // self.block_size, released + len(blocks))
        start = self._num_registered.get(request_id, 0)
        if full <= start:
            return
        keys = chain_keys(token_ids[:full * self.block_size], self.block_size,
                          self._keys.get(request_id, [])[:full], extra)
        self._keys[request_id] = keys
        for i in range(max(start, released), full):
            self.pool.cache(blocks[i - released], keys[i])
        self._num_registered[request_id] = full

    def release_out_of_window(self, request_id: str, num_computed_tokens: int) -> int:
        """Release the leading blocks no query from position num_computed_tokens on can see (a
        query at p sees p - window < k <= p); how many. Nothing without a window."""
        blocks = self._blocks.get(request_id)
        if self.window is None or not blocks:
            return 0
        first_needed = self._first_needed(num_computed_tokens)
        released = self._released.get(request_id, 0)
        n = min(first_needed - released, len(blocks) - 1)
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
        keep = self.blocks_needed(num_tokens) - self._released.get(request_id, 0)
        assert keep + self._released.get(request_id, 0) >= self._num_registered.get(request_id, 0), \
            "trim would drop a cached block"
        if keep < len(blocks):
            self.pool.free(list(reversed(blocks[keep:])))
            del blocks[keep:]

    def free(self, request_id: str) -> None:
        """Release the request's blocks, tail first: a suffix is evicted before its prefix."""
        blocks = self._blocks.pop(request_id, [])
        self._released.pop(request_id, None)
        self._num_registered.pop(request_id, None)
        self._keys.pop(request_id, None)
        self.pool.free(list(reversed(blocks)))

    def block_ids(self, request_id: str) -> list[int]:
        """The request's table: a block per position block, the null block where one was released."""
        return [NULL_BLOCK_ID] * self._released.get(request_id, 0) + [b.block_id for b in self._blocks.get(request_id, [])]

    def table_length(self, request_id: str) -> int:
        return self._released.get(request_id, 0) + len(self._blocks.get(request_id, []))

    def num_blocks_of(self, request_id: str) -> int:
        """Blocks the request holds."""
        return len(self._blocks.get(request_id, []))

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.num_used_blocks / self.pool.num_blocks

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        held: dict[int, int] = {}
        for blocks in self._blocks.values():
            for b in blocks:
                held[b.block_id] = held.get(b.block_id, 0) + 1
        for b in self.pool.blocks:
            assert held.get(b.block_id, 0) == b.ref_cnt, (
                f"block {b.block_id}: ref_cnt {b.ref_cnt} but held by {held.get(b.block_id, 0)} tables")
