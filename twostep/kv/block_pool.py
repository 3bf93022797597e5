"""The pool of KV blocks: reference counts, a free queue in eviction order, and the prefix
cache (chained block key -> block).

Pure bookkeeping; the tensors live in kv/cache_tensors.py. A block is either in use
(ref_cnt > 0) or in the free queue (ref_cnt == 0). A block in the free queue may still hold
cached K/V (block_key set): it is evictable, and a prefix-cache hit revives it by taking it
out of the middle of the queue, which is why the queue is a doubly linked list (O(1)).
New blocks come from the front of the queue, the least recently freed, evicting what they
cached.

Block 0 is the null block (vLLM's): it belongs to no request and is never handed out, so block
tables can be padded with it; the cache tensors hold num_blocks + 1 blocks for it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from twostep.kv.block_hash import BlockKey

NULL_BLOCK_ID = 0


@dataclass(slots=True, eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_key: BlockKey | None = None        # set while the block is in the prefix cache
    prev_free: "KVBlock | None" = field(default=None, repr=False)
    next_free: "KVBlock | None" = field(default=None, repr=False)
    in_free_queue: bool = False


class FreeBlockQueue:
    """Doubly linked list of free blocks: pop from the front (least recently freed), append
    at the back, remove anywhere, all O(1)."""

    def __init__(self, blocks: list[KVBlock]) -> None:
        self._head: KVBlock | None = None
        self._tail: KVBlock | None = None
        self.num_free = 0
        for b in blocks:
            self.append(b)

    def append(self, block: KVBlock) -> None:
        assert not block.in_free_queue, f"block {block.block_id} is already free"
        block.prev_free, block.next_free = self._tail, None
        if self._tail is None:
            self._head = block
        else:
            self._tail.next_free = block
        self._tail = block
        block.in_free_queue = True
        self.num_free += 1

    def popleft(self) -> KVBlock:
        if self._head is None:
            raise RuntimeError("no free KV blocks")
        block = self._head
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        assert block.in_free_queue, f"block {block.block_id} is not free"
        if block.prev_free is None:
            self._head = block.next_free
        else:
            block.prev_free.next_free = block.next_free
        if block.next_free is None:
            self._tail = block.prev_free
        else:
            block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        block.in_free_queue = False
        self.num_free -= 1

    def __iter__(self):
        b = self._head
        while b is not None:
            yield b
            b = b.next_free


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.blocks = [KVBlock(i) for i in range(NULL_BLOCK_ID + 1, num_blocks + 1)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[int, KVBlock] = {}
        self.num_evictions = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now, cached-but-evictable ones included."""
        return self.free_queue.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached)

    def allocate(self, n: int) -> list[KVBlock]:
        if n > self.num_free_blocks:
            raise RuntimeError(f"asked for {n} KV blocks, {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: KVBlock) -> None:
        if block.block_key is not None:
            del self.cached[block.block_key.value]
            block.block_key = None
            self.num_evictions += 1

    def lookup(self, key: BlockKey) -> KVBlock | None:
        """The cached block holding exactly this key's tokens after this parent, if any."""
        block = self.cached.get(key.value)
        if block is None or not block.block_key.confirms(key):
            return None
        return block

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take a reference on cached blocks (reviving evictable ones from the free queue)."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def cache(self, block: KVBlock, key: BlockKey) -> bool:
        """Register a full, computed block under its key. If another block already holds the
        same key (two requests computed the same prefix at once), keep that one."""
        if block.block_key is not None or key.value in self.cached:
            return False
        block.block_key = key
        self.cached[key.value] = block
        return True

    def free(self, blocks: list[KVBlock]) -> None:
        """Drop one reference from each; blocks reaching zero join the back of the queue in
        the order given (callers pass a request's blocks tail first, so tails evict first)."""
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of block {block.block_id}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def reset_prefix_cache(self) -> None:
        """Forget every evictable cached block (blocks in use keep their keys)."""
        for block in list(self.cached.values()):
            if block.ref_cnt == 0:
                del self.cached[block.block_key.value]
                block.block_key = None

    def check_integrity(self) -> None:
        """Every block is either free (ref 0, queued once) or in use (ref > 0, not queued);
        the cache maps each key to the one block that carries it."""
        queued = list(self.free_queue)
        ids = [b.block_id for b in queued]
        assert len(ids) == len(set(ids)), "a block is queued twice"
        assert len(ids) == self.free_queue.num_free, "free count disagrees with the queue"
        for b in self.blocks:
            if b.in_free_queue:
                assert b.ref_cnt == 0, f"free block {b.block_id} has ref_cnt {b.ref_cnt}"
            else:
                assert b.ref_cnt > 0, f"block {b.block_id} is neither free nor in use"
            if b.block_key is not None:
                assert self.cached.get(b.block_key.value) is b, f"block {b.block_id} key not mapped"
        for value, b in self.cached.items():
            assert b.block_key is not None and b.block_key.value == value, "stale cache entry"
        in_use = sum(b.ref_cnt > 0 for b in self.blocks)
        assert self.num_free_blocks + in_use == self.num_blocks
