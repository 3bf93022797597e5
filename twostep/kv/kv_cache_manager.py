"""Per-request block tables, one per KV-cache group, with automatic prefix caching.

A group is the layers that attend over the same span: every layer of most models (one group), or,
in a model that mixes them (Gemma 2/3), the full-attention layers and the sliding-window layers,
each group with its own pool of blocks in its own tensors (llama.cpp's SWA cache beside the main
one; vLLM's KV-cache groups share one pool instead). A sliding-window group's blocks that fall out
of the window are freed and reused (kv/block_tables.py), so its memory is bounded by the window
however long the sequence, and its pool is sized for that: the windows of max_num_seqs sequences
and a step's new tokens (core/execution/model_builder.py).

The scheduler asks for room for `num_new_tokens` more tokens of a request (a prefill chunk, one
decode token, or k+1 tokens of a speculative verification step); the manager grows every group's
table to cover them, or says no without side effects.

Prefix caching: before a request's first chunk, get_computed_blocks() walks its full blocks
through each group's cache by chained key and returns the longest hit every group serves (never all
of the tokens: the last one is always computed, so its logits exist); a sliding-window group
needs only the blocks the next query sees. After every step, cache_full_blocks() registers the
blocks that became full and computed, prompt and generated tokens alike, so the next turn of a chat
hits them too.

A hybrid model (linear-attention layers beside attention ones) has state slots too
(kv/state_slots.py): a live slot per running sequence, allocated and freed with its blocks, and
states saved at prompt block boundaries that a prefix hit must find at the same position as the
blocks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Sequence

from twostep.kv.block_hash import BlockKey, chain_keys
from twostep.kv.block_pool import BlockPool, KVBlock
from twostep.kv.block_tables import BlockTables
from twostep.kv.state_slots import StateSlots, StateStep


@dataclass(slots=True, frozen=True)
class KVGroupSpec:
    num_blocks: int
    window: int | None = None        # every layer of the group attends within it (None: full attention)


@dataclass(slots=True)
class PrefixCacheStats:
    queries: int = 0     # tokens looked up
    hits: int = 0        # tokens served from cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 window: int | None = None, more_groups: Sequence[KVGroupSpec] = (),
                 num_state_slots: int = 0) -> None:
        """num_blocks, window: the first group's (all layers where they attend alike); more_groups:
        the others (a mixed model's sliding-window layers); num_state_slots: a hybrid model's
        state slots (0: no linear-attention layers)."""
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.groups = [BlockTables(g.num_blocks, block_size, g.window)
                       for g in (KVGroupSpec(num_blocks, window), *more_groups)]
        self.states = StateSlots(num_state_slots, block_size) if num_state_slots else None
        self.prefix_stats = PrefixCacheStats()
        self._keys: dict[str, list[BlockKey]] = {}

    @property
    def pool(self) -> BlockPool:
        """The first group's pool (a single-group model's only one)."""
        return self.groups[0].pool

    @property
    def window(self) -> int | None:
        return self.groups[0].window

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def sequence_capacity(self, chunk: int) -> int:
        """The longest sequence the whole cache holds, prefilled `chunk` tokens a step: any length
        in a group whose window's and chunk's blocks fit (they are all it holds), else its tokens."""
        def capacity(g: BlockTables) -> int:
            if g.window is not None and g.sequence_blocks(1 << 62, chunk) <= g.pool.num_blocks:
                return 1 << 62
            return g.pool.num_blocks * self.block_size
        return min(capacity(g) for g in self.groups)

    def get_computed_blocks(self, request_id: str, token_ids: Sequence[int], extra: Hashable = None
                            ) -> tuple[list[list[KVBlock | None]], int]:
        """Each group's leading cached blocks of these tokens (None: out of its window) and how
        many tokens they cover. Takes no reference (pass them to allocate_slots, which does) and
        counts nothing (record_lookup)."""
        if not self.enable_prefix_caching:
            return [], 0
        keys = chain_keys(token_ids, self.block_size, self._keys.get(request_id, []), extra)
        self._keys[request_id] = keys
        # Cap at len - 1 tokens: the last token must run through the model for its logits.
        usable = (len(token_ids) - 1) // self.block_size
        cached = [g.lookup(keys[:usable]) for g in self.groups]
        saved = self.states.lookup(keys[:usable]) if self.states else None
        longest = usable
        for g, c in zip(self.groups, cached):
            if g.window is None:         # a full-attention group needs every leading block
                longest = min(longest, next((i for i, b in enumerate(c) if b is None), usable))
        parted = False
        for n in range(longest, 0, -1):
            covered = all(g.hit_covers(c, n) for g, c in zip(self.groups, cached))
            if saved is not None and not self.states.hit_covers(saved, n):
                if covered and not parted:      # blocks but no state: save one there this time
                    self.states.parted_at(request_id, n * self.block_size)
                    parted = True
                continue
            if covered:
                hit = [g.hit_blocks(c, n) for g, c in zip(self.groups, cached)]
                if saved is not None:       # the saved state, after the groups' blocks
                    hit.append([saved[n - 1]])
                return hit, n * self.block_size
        return [], 0

    def record_lookup(self, num_tokens: int, num_hit: int) -> None:
        """Count one prefix-cache lookup that was used (the request got its blocks); lookups of
        a request that must keep waiting are repeated later and not counted twice."""
        if self.enable_prefix_caching:
            self.prefix_stats.queries += num_tokens
            self.prefix_stats.hits += num_hit

    def allocate_slots(self, request_id: str, num_computed_tokens: int, num_new_tokens: int,
                       computed_blocks: Sequence[Sequence[KVBlock | None]] = ()) -> bool:
        """Make the request's tables cover num_computed_tokens + num_new_tokens positions, starting
        from computed_blocks (get_computed_blocks' hits) for a request with no table yet; in every
        group or in none."""
        hits = list(computed_blocks) or [()] * len(self.groups)
        state_hit = hits.pop()[0] if len(hits) > len(self.groups) else None
        total = num_computed_tokens + num_new_tokens
        if any(g.shortfall(request_id, total, h) for g, h in zip(self.groups, hits)):
            return False
        if self.states is not None and self.states.shortfall(request_id, state_hit):
            return False
        for g, h in zip(self.groups, hits):
            g.allocate(request_id, total, h)
        if self.states is not None:
            self.states.allocate(request_id, state_hit)
        return True

    def state_step(self, request_id: str, start: int, num_tokens: int, num_prompt_tokens: int) -> StateStep | None:
        """A hybrid model's state slots for the request's step (None: no linear-attention layers)."""
        if self.states is None:
            return None
        return self.states.step(request_id, start, num_tokens, num_prompt_tokens, self.enable_prefix_caching)

    def cache_full_blocks(self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int,
                          extra: Hashable = None) -> None:
        """Offer every block that is now full and computed to the prefix cache."""
        if not self.enable_prefix_caching:
            return
        full = num_computed_tokens // self.block_size
        if all(g.num_registered(request_id) >= full or not g.num_blocks_of(request_id) for g in self.groups):
            if self.states is not None:
                self.states.stepped(request_id, self._keys.get(request_id, [])[:full], num_computed_tokens)
            return
        keys = chain_keys(token_ids[:full * self.block_size], self.block_size,
                          self._keys.get(request_id, [])[:full], extra)
        self._keys[request_id] = keys
        for g in self.groups:
            g.cache_full_blocks(request_id, keys, full)
        if self.states is not None:
            self.states.stepped(request_id, keys, num_computed_tokens)

    def release_out_of_window(self, request_id: str, num_computed_tokens: int) -> int:
        """Release the blocks of sliding-window groups that no query from num_computed_tokens on
        sees; how many."""
        return sum(g.release_out_of_window(request_id, num_computed_tokens) for g in self.groups)

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Release the blocks past the first num_tokens positions (rejected drafts' slots)."""
        for g in self.groups:
            g.trim(request_id, num_tokens)

    def free(self, request_id: str) -> None:
        self._keys.pop(request_id, None)
        for g in self.groups:
            g.free(request_id)
        if self.states is not None:
            self.states.free(request_id)

    def block_ids(self, request_id: str, group: int = 0) -> list[int]:
        """One group's table: a block per position block, the null block where one was released."""
        return self.groups[group].table(request_id)

    def tables(self, request_id: str) -> list[list[int]]:
        """Every group's table, in group order."""
        return [g.table(request_id) for g in self.groups]

    def table_length(self, request_id: str) -> int:
        return self.groups[0].table_length(request_id)

    def num_blocks_of(self, request_id: str) -> int:
        """Blocks the request holds, in all groups."""
        return sum(g.num_blocks_of(request_id) for g in self.groups)

    @property
    def num_blocks(self) -> int:
        return sum(g.pool.num_blocks for g in self.groups)

    @property
    def num_free_blocks(self) -> int:
        return sum(g.pool.num_free_blocks for g in self.groups)

    @property
    def num_used_blocks(self) -> int:
        return sum(g.pool.num_used_blocks for g in self.groups)

    @property
    def num_cached_blocks(self) -> int:
        return sum(g.pool.num_cached_blocks for g in self.groups)

    @property
    def num_evictions(self) -> int:
        return sum(g.pool.num_evictions for g in self.groups)

    @property
    def usage(self) -> float:
        """The fullest group's share of its blocks in use."""
        pools = [g.pool for g in self.groups] + ([self.states.pool] if self.states is not None else [])
        return max(p.num_used_blocks / p.num_blocks for p in pools)

    @property
    def num_free_state_slots(self) -> int:
        return self.states.pool.num_free_blocks if self.states is not None else 0

    def reset_prefix_cache(self) -> None:
        for g in self.groups:
            g.pool.reset_prefix_cache()
        if self.states is not None:
            self.states.pool.reset_prefix_cache()

    def check_integrity(self) -> None:
        for g in self.groups:
            g.check_integrity()
        if self.states is not None:
            self.states.check_integrity()
