"""Weights in transparent huge pages: the tensors a decode step streams, copied once at load into
anonymous memory advised for 2 MiB pages (madvise MADV_HUGEPAGE).

A decode step reads every weight once, a few hundred MB in 4 KiB pages: a new page each 4 KiB,
each a TLB miss and a page walk, and the hardware prefetchers stop at every page's end. Where the
kernel is set to give huge pages on request (/sys/kernel/mm/transparent_hugepage/enabled
`madvise`, the usual default, or `always`), a 2 MiB page takes 512 of those breaks away. The same
97 Qwen2.5-0.5B-shape linears at one row, alternating in one process (benchmarks/RESULTS.md):
Q4_0 1.16x, Q8_0 1.13x. The arena is one bump allocator over a few large mappings (a tensor
never straddles two), so a model's weights cost about their size in 2 MiB pages, not a page each.
Where the kernel says `never` or the system has no madvise, tensors stay where they are.

The originals a copy replaces are freed by their owners, but glibc keeps freed heap until asked:
the arena asks every TRIM_EVERY bytes, so where the originals go as they are replaced (bf16
layers) a load's peak grows by little (bf16 Qwen2.5-0.5B shape: 2.53 GB peak against 2.45 without
the arena; 3.01 without asking); quantized weights were already repacked into new tensors, and the
copies take their place. The arena's mappings live as long as the tensors placed in them (each
holds its mmap): with the engine and its platform.
"""
from __future__ import annotations

import ctypes
import logging
import mmap

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
CHUNK = 256 << 20         # a mapping's size (address space only: untouched pages cost nothing)
ALIGN = 64                # each tensor starts on a cache line
TRIM_EVERY = 64 << 20     # placed bytes between asking glibc to return the heap freed meanwhile
THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


def thp_setting() -> str:
    """The kernel's transparent-huge-page mode (always, madvise, never), or "unavailable"."""
    try:
        with open(THP_SETTING) as f:
            text = f.read()
    except OSError:
        return "unavailable"
    return text[text.find("[") + 1:text.find("]")] if "[" in text else "unavailable"


class HugePageArena:
    """Copies of tensors in memory advised for 2 MiB pages. place() is the only way in; a tensor
    it returns keeps its mapping alive (torch.frombuffer holds the mmap)."""

    def __init__(self, chunk_bytes: int = CHUNK) -> None:
        self.chunk_bytes = chunk_bytes
        self._chunks: list[torch.Tensor] = []      # each mapping as uint8, from its first 2 MiB boundary
        self._used = 0                             # bytes taken of the last chunk
        self.placed_bytes = 0
        self._trimmed_at = 0                       # placed_bytes when the heap was last trimmed

    @staticmethod
    def available() -> bool:
        return hasattr(mmap, "MADV_HUGEPAGE") and thp_setting() in ("always", "madvise")

    def place(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """A contiguous copy of t in the arena (t itself if None, already here, or not a plain
        CPU tensor)."""
        if t is None or t.device.type != "cpu" or t.layout != torch.strided or t.numel() == 0 or self.holds(t):
            return t
        if self.placed_bytes - self._trimmed_at >= TRIM_EVERY:    # the originals replaced so far
            give_back_freed_memory()
            self._trimmed_at = self.placed_bytes
        nbytes = t.numel() * t.element_size()
        start = (self._used + ALIGN - 1) // ALIGN * ALIGN
        if not self._chunks or start + nbytes > self._chunks[-1].numel():
            self._chunks.append(self._map(max(self.chunk_bytes, nbytes)))
            start = 0
        self._used = start + nbytes
        self.placed_bytes += nbytes
        copy = self._chunks[-1][start:start + nbytes].view(t.dtype).view(t.shape)
        with torch.no_grad():
            copy.copy_(t)
        return copy

    def holds(self, t: torch.Tensor) -> bool:
        address = t.data_ptr()
        return any(c.data_ptr() <= address < c.data_ptr() + c.numel() for c in self._chunks)

    @staticmethod
    def _map(nbytes: int) -> torch.Tensor:
        length = (nbytes + 2 * HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE    # room to start on a boundary
        region = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        try:
            region.madvise(mmap.MADV_HUGEPAGE)
        except OSError as e:          # refused (a sandbox's seccomp profile): ordinary pages, still correct
            logger.warning("madvise(MADV_HUGEPAGE) refused (%s): weights in 4 KiB pages", e)
        whole = torch.frombuffer(region, dtype=torch.uint8)
        skip = -whole.data_ptr() % HUGE_PAGE
        return whole[skip:skip + length - HUGE_PAGE]


def give_back_freed_memory() -> None:
    """glibc keeps the heap a program freed unless asked: malloc_trim returns it to the system."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):       # not glibc
        pass
