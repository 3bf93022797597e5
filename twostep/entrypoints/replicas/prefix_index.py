"""Which replica has seen which prompt prefixes: the router's picture of the replicas' prefix caches.

A prompt's routing text is cut into blocks of BLOCK_CHARS characters and each block is named by a
hash of itself and every block before it, as the engine names its KV blocks by a hash chain over
token blocks: a block's hash matches only where the whole text up to it matches. Each replica keeps
the hashes of the prompts routed to it, least recently used first, up to a bound (an engine's cache
also evicts the least recently used). A request's match on a replica is its leading run of blocks
that replica holds: a lower bound on the text its prefix cache can serve, where it has not evicted it.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

BLOCK_CHARS = 64                 # about a 16-token KV block of English text
MAX_BLOCKS_PER_REPLICA = 1 << 16  # ~4M characters a replica is assumed to keep cached


def block_hashes(text: str, block_chars: int = BLOCK_CHARS) -> list[bytes]:
    """The chained hashes of text's whole blocks (a partial last block is not cached by an engine)."""
    hashes, parent = [], b""
    for start in range(0, len(text) - block_chars + 1, block_chars):
        parent = hashlib.blake2b(parent + text[start:start + block_chars].encode("utf-8", "surrogatepass"),
                                 digest_size=16).digest()
        hashes.append(parent)
    return hashes


@dataclass(frozen=True, slots=True)
class Match:
    blocks: int          # leading blocks the replica holds
    of: int              # the request's whole blocks

    @property
    def ratio(self) -> float:
        return self.blocks / self.of if self.of else 0.0


class PrefixIndex:
    """Per replica, the block hashes of the prompts it was sent (LRU, bounded)."""

    def __init__(self, max_blocks_per_replica: int = MAX_BLOCKS_PER_REPLICA) -> None:
        self.max_blocks = max_blocks_per_replica
        self._held: dict[str, OrderedDict[bytes, None]] = {}

    def match(self, replica: str, hashes: list[bytes]) -> Match:
        held = self._held.get(replica)
        n = 0
        if held:
            for h in hashes:
                if h not in held:
                    break
                n += 1
        return Match(n, len(hashes))

    def insert(self, replica: str, hashes: list[bytes]) -> None:
        held = self._held.setdefault(replica, OrderedDict())
        for h in hashes:
            held[h] = None
            held.move_to_end(h)
        while len(held) > self.max_blocks:
            held.popitem(last=False)

    def size(self, replica: str) -> int:
        return len(self._held.get(replica, ()))

    def forget(self, replica: str) -> None:
        """A replica that died (its cache died with it)."""
        self._held.pop(replica, None)
