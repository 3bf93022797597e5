"""Chained block identity for prefix caching.

A full block is identified by its parent's hash, its own token ids and any extra key that
changes the K/V it holds (a LoRA adapter, a model revision, a KV dtype). Equal hashes are
confirmed by comparing parent and tokens, so a hash collision can never serve wrong K/V.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Sequence


@dataclass(slots=True, frozen=True)
class BlockKey:
    value: int                       # the chained hash: dict key of the cache
    parent: int | None               # the previous block's value (None for the first block)
    token_ids: tuple[int, ...]
    extra: Hashable = None

    def confirms(self, other: "BlockKey") -> bool:
        return (self.parent == other.parent and self.token_ids == other.token_ids
                and self.extra == other.extra)


def block_key(parent: BlockKey | None, token_ids: Sequence[int], extra: Hashable = None) -> BlockKey:
    parent_value = None if parent is None else parent.value
    tokens = tuple(token_ids)
    # Built-in hash of ints is not salted per process, so values are stable across runs.
    return BlockKey(hash((parent_value, tokens, extra)), parent_value, tokens, extra)


def chain_keys(token_ids: Sequence[int], block_size: int, start: list[BlockKey],
               extra: Hashable = None) -> list[BlockKey]:
    """Extend `start` (keys of the first blocks) with keys for every further full block."""
    keys = list(start)
    for i in range(len(keys), len(token_ids) // block_size):
        keys.append(block_key(keys[-1] if keys else None,
                              token_ids[i * block_size:(i + 1) * block_size], extra))
    return keys
