"""The state slots of a hybrid model's linear-attention layers (Gated DeltaNet: Qwen3.5, Qwen3-Next),
beside the paged K/V of its attention layers (vLLM v1's hybrid KV-cache manager, its Mamba spec).

A linear-attention layer keeps, per sequence, a fixed-size state (its convolution's last inputs
and a recurrent matrix per head) instead of K/V that grow with the context. A slot holds that
state for every such layer; slots come from a pool like blocks (kv/block_pool.py: ref counts, a free
queue in eviction order, the prefix cache by block key, slot 0 never handed out).

- Each running sequence holds one live slot from its first step to its end (finish, abort,
  preemption free it). The state cannot be cut back like a table: a rejected draft's update is
  undone by the model runner, which keeps the state of each verified position (layers/gated_deltanet.py).
- Prefix caching: a state is only valid at the position it was taken, so it is saved at
  block-aligned positions of a prompt: the last block boundary before its last token (where a
  repeat of the prompt and the next turn of a chat hit), and where the request's lookup found the
  attention layers' blocks cached further than any saved state (where it parts from an earlier
  prompt: a shared system prompt's end, so the next request with it hits). The step that passes such
  a position copies the state into a save slot; once the step is applied the slot is registered
  under the key of the block ending there and released (evictable, like a freed cached block). A hit
  needs the attention layers' blocks and a saved state at the same position; the request's first
  step copies the saved state into its live slot (its restore), holding the saved one until then.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from twostep.kv.block_hash import BlockKey
from twostep.kv.block_pool import BlockPool, KVBlock


@dataclass(slots=True, frozen=True)
class StateStep:
    """A request's state slots for one step, as the model runner receives them."""

    slot: int                      # its live state, read and written in place
    restore: int = 0               # copy this saved state into the live slot first (a prefix hit)
    fresh: bool = False            # the sequence starts here from nothing: zero the live state
    # (after this many of the step's tokens, the slot to copy the state into), in order
    saves: tuple[tuple[int, int], ...] = ()


class StateSlots:
    def __init__(self, num_slots: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_slots)
        self._live: dict[str, KVBlock] = {}
        self._restore: dict[str, KVBlock] = {}               # held until the first step ran
        self._save: dict[str, list[tuple[int, KVBlock]]] = {}   # (position, slot) until registered
        self._parted: dict[str, int] = {}                    # where the lookup found blocks but no state

    def lookup(self, keys: Sequence[BlockKey]) -> list[KVBlock | None]:
        return [self.pool.lookup(key) for key in keys]

    def hit_covers(self, cached: Sequence[KVBlock | None], n: int) -> bool:
        """A hit of n blocks needs the state saved after them."""
        return n > 0 and cached[n - 1] is not None

    def shortfall(self, request_id: str, hit: KVBlock | None) -> int:
        """Slots the pool lacks for the request's live state (0: it has them)."""
        if request_id in self._live:
            return 0
        revived = hit is not None and hit.ref_cnt == 0
        return max(0, 1 - (self.pool.num_free_blocks - revived))

    def allocate(self, request_id: str, hit: KVBlock | None) -> None:
        """A live slot for a request that has none, and a hold on the saved state it starts from."""
        if request_id in self._live:
            return
        if hit is not None:
            self.pool.touch([hit])
            self._restore[request_id] = hit
        self._live[request_id] = self.pool.allocate(1)[0]

    def parted_at(self, request_id: str, position: int) -> None:
        """The request's lookup found the attention blocks cached up to `position` but no state
        saved there: its prompt parts there from an earlier one, so its state is worth saving there."""
        self._parted[request_id] = position

    def step(self, request_id: str, start: int, num_tokens: int, num_prompt_tokens: int,
             save: bool) -> StateStep:
        """The request's slots for a step computing [start, start + num_tokens); with `save`, saves
        of the state at the positions worth it (the prompt's last block boundary, where it parts from
        an earlier prompt) that the step passes, as free slots allow."""
        restore = self._restore.get(request_id)
        saves = []
        if save:
            end = (num_prompt_tokens - 1) // self.block_size * self.block_size
            pending = self._save.setdefault(request_id, [])
            for at in sorted({self._parted.get(request_id, 0), end}):
                if start < at <= start + num_tokens and self.pool.num_free_blocks:
                    slot = self.pool.allocate(1)[0]
                    pending.append((at, slot))
                    saves.append((at - start, slot.block_id))
        return StateStep(self._live[request_id].block_id, restore.block_id if restore else 0,
                         fresh=start == 0 and restore is None, saves=tuple(saves))

    def stepped(self, request_id: str, keys: Sequence[BlockKey], num_computed_tokens: int) -> None:
        """After a step: the saved state it started from is no longer needed, and the states it
        saved go into the prefix cache (keys: the request's block keys so far)."""
        restore = self._restore.pop(request_id, None)
        if restore is not None:
            self.pool.free([restore])
        pending = self._save.get(request_id, [])
        for at, slot in [p for p in pending if p[0] <= num_computed_tokens]:
            block = at // self.block_size
            if block <= len(keys):
                self.pool.cache(slot, keys[block - 1])
            self.pool.free([slot])
            pending.remove((at, slot))

    def free(self, request_id: str) -> None:
        held = [self._live.pop(request_id, None), self._restore.pop(request_id, None)]
        held += [slot for _, slot in self._save.pop(request_id, [])]
        self._parted.pop(request_id, None)
        self.pool.free([s for s in held if s is not None])

    def holds(self, request_id: str) -> int:
        return int(request_id in self._live)

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        held: dict[int, int] = {}
        saving = [slot for pending in self._save.values() for _, slot in pending]
        for slot in [*self._live.values(), *self._restore.values(), *saving]:
            held[slot.block_id] = held.get(slot.block_id, 0) + 1
        for s in self.pool.blocks:
            assert held.get(s.block_id, 0) == s.ref_cnt, (
                f"state slot {s.block_id}: ref_cnt {s.ref_cnt} but held {held.get(s.block_id, 0)} times")
