"""The pool of KV blocks: reference counts and a free queue in eviction order.

Pure bookkeeping; the tensors live in kv/cache_tensors.py. A block is either in use
(ref_cnt > 0) or in the free queue (ref_cnt == 0). The queue is a doubly linked list so a
block can leave it from anywhere in O(1): prefix caching (block_hash set) revives a
free-but-cached block by taking it out of the middle of the queue.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True, eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None            # set once full and cached (prefix caching)
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
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def allocate(self, n: int) -> list[KVBlock]:
        if n > self.num_free_blocks:
            raise RuntimeError(f"asked for {n} KV blocks, {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            block.block_hash = None  # reused: whatever it cached is gone
            block.ref_cnt = 1
            out.append(block)
        return out

    def free(self, blocks: list[KVBlock]) -> None:
        """Drop one reference from each; blocks reaching zero join the back of the queue in
        the order given (callers pass a request's blocks tail first, so tails evict first)."""
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of block {block.block_id}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def check_integrity(self) -> None:
        """Every block is either free (ref 0, queued once) or in use (ref > 0, not queued)."""
        queued = list(self.free_queue)
        ids = [b.block_id for b in queued]
        assert len(ids) == len(set(ids)), "a block is queued twice"
        assert len(ids) == self.free_queue.num_free, "free count disagrees with the queue"
        for b in self.blocks:
            if b.in_free_queue:
                assert b.ref_cnt == 0, f"free block {b.block_id} has ref_cnt {b.ref_cnt}"
            else:
                assert b.ref_cnt > 0, f"block {b.block_id} is neither free nor in use"
        assert self.num_free_blocks + sum(b.ref_cnt > 0 for b in self.blocks) == self.num_blocks
