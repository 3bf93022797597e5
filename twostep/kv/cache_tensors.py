"""Sizing and allocating the KV cache tensors: one [2, num_blocks, block_size, kv_heads, head_dim]
tensor per layer (K at index 0, V at 1)."""
from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass

import torch

from twostep.attention.kv_layer_cache import KVLayerCache
from twostep.config import KV_FORMATS, SCALE_DTYPE, KVFormat

logger = logging.getLogger(__name__)

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 10**3, "KIB": 1 << 10, "M": 1 << 20, "MB": 10**6,
          "MIB": 1 << 20, "G": 1 << 30, "GB": 10**9, "GIB": 1 << 30, "T": 1 << 40, "TB": 10**12,
          "TIB": 1 << 40}


def parse_bytes(text: str | int) -> int:
    """'2GiB', '512MB', '1.5G' or a plain number of bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"kv_cache_memory {text!r} is not a size like '2GiB' or '512MB'")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


@dataclass(slots=True, frozen=True)
class KVGroupPlan:
    """One KV-cache group's blocks (kv/kv_cache_manager.py): the layers that attend over one span."""

    num_layers: int
    bytes_per_token: int          # its layers' K and V of one token
    num_blocks: int
    window: int | None = None     # their sliding window (None: full attention)


@dataclass(slots=True, frozen=True)
class KVCachePlan:
    block_size: int
    groups: tuple[KVGroupPlan, ...]
    kv_dtype: str = "auto"
    scaled: bool = False

    @property
    def num_blocks(self) -> int:
        """The first group's blocks: a model whose layers all attend alike has no other."""
        return self.groups[0].num_blocks

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def bytes_per_token(self) -> int:
        return sum(g.bytes_per_token for g in self.groups)

    @property
    def total_bytes(self) -> int:
        """What the cache tensors take: the requests' blocks and each group's null block."""
        return sum((g.num_blocks + 1) * self.block_size * g.bytes_per_token for g in self.groups)

    def describe(self) -> str:
        first = self.groups[0]
        text = (f"KV cache ({self.kv_dtype}): {first.num_blocks} blocks (+ the null block) x {self.block_size} tokens = "
                f"{self.num_tokens} tokens, {first.bytes_per_token} bytes/token "
                f"(2 x layers x kv_heads x (head_dim x dtype bytes{' + scale' if self.scaled else ''}))")
        for g in self.groups[1:]:
            text += (f"; the {g.num_layers} layers of window {g.window}: {g.num_blocks} blocks of their own "
                     f"({g.bytes_per_token} bytes/token), freed as the window passes")
        return text + f", {self.total_bytes / 2**20:.1f} MiB"


@dataclass(slots=True, frozen=True)
class KVGroupNeed:
    """What a group's blocks cost and the most it can use: plan_kv_cache's input."""

    num_layers: int
    bytes_per_token: int
    window: int | None = None
    max_blocks: int | None = None     # the most blocks it ever holds (None: as many as the first group)


def available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo; pass --kv-cache-memory")


def total_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1]
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def process_memory(device: torch.device) -> int:
    """What this process holds on the device now (CPU: its resident set)."""
    if device.type == "cuda":
        return torch.cuda.memory_reserved(device)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def plan_kv_cache(needs: list[KVGroupNeed], block_size: int, device: torch.device,
                  kv_cache_memory: str | int | None, memory_fraction: float,
                  max_useful_tokens: int, num_blocks_override: int | tuple[int, ...] | None = None,
                  memory_utilization: float | None = None) -> KVCachePlan:
    """Blocks from an explicit budget; or, with memory_utilization (vLLM's gpu_memory_utilization),
    from that fraction of the device's memory less what the process already holds (the weights);
    or from a fraction of free memory capped at what max_num_seqs sequences of max_model_len tokens
    (max_useful_tokens) could ever use. A sliding-window group takes no more than its max_blocks
    (a window's worth per sequence); the first group (full attention) the rest."""
    if num_blocks_override is not None:
        counts = (num_blocks_override if isinstance(num_blocks_override, tuple)
                  else (num_blocks_override,) * len(needs))
        return _plan(block_size, needs, counts)
    bytes_per_block = sum(n.bytes_per_token for n in needs) * block_size
    useful_blocks = -(-max_useful_tokens // block_size)
    useful = sum(min(useful_blocks, n.max_blocks or useful_blocks) * n.bytes_per_token * block_size for n in needs)
    if kv_cache_memory is not None:
        budget = parse_bytes(kv_cache_memory)
    elif memory_utilization is not None:
        held = process_memory(device)
        budget = int(total_memory(device) * memory_utilization) - held
        if budget < bytes_per_block:
            raise ValueError(f"gpu_memory_utilization {memory_utilization} of {total_memory(device) / 2**30:.1f} "
                             f"GiB leaves no room for the KV cache after the {held / 2**20:.0f} MiB this "
                             "process holds (the weights); raise it or pass --kv-cache-memory")
        budget = min(budget, useful)
    else:
        budget = min(int(available_memory(device) * memory_fraction), useful)
    first = _first_group_blocks(needs, block_size, budget)
    if first < 1:
        raise ValueError(f"KV cache budget of {budget} bytes holds no block of {bytes_per_block} bytes;"
                         " raise --kv-cache-memory")
    return _plan(block_size, needs, [first] * len(needs))


def _first_group_blocks(needs: list[KVGroupNeed], block_size: int, budget: int) -> int:
    """The most blocks the first group gets where every other takes min(that, its max_blocks)."""
    def cost(blocks: int) -> int:
        return sum(min(blocks, n.max_blocks or blocks) * n.bytes_per_token * block_size for n in needs)
    lo, hi = 0, budget // (needs[0].bytes_per_token * block_size)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if cost(mid) <= budget else (lo, mid - 1)
    return lo


def _plan(block_size: int, needs: list[KVGroupNeed], counts) -> KVCachePlan:
    return KVCachePlan(block_size, tuple(
        KVGroupPlan(n.num_layers, n.bytes_per_token, min(c, n.max_blocks or c), n.window)
        for n, c in zip(needs, counts, strict=True)))


def allocate_kv_cache(plan: KVCachePlan, num_layers: int, num_kv_heads: int, head_dim: int,
                      dtype: torch.dtype, device: torch.device,
                      fmt: KVFormat = KV_FORMATS["auto"], layer_groups: list[int] | None = None) -> list[KVLayerCache]:
    """Each group's blocks for requests and its null block (block 0: table padding), all
    uninitialised on purpose: zeroing gigabytes costs seconds at start (5.5 s for 5.7
    GiB on this CPU) and, on Linux, empty pages cost no memory until a block is first written. The
    model runner zeroes the null block at start and every other block on its first use.
    Every layer's cache is a view of its group's tensor [layers, 2, blocks, ...] (and the scales of
    another), so a block is zeroed in all its layers at once (attention/kv_layer_cache.py,
    block_fills). layer_groups: each layer's group (None: all in the first)."""
    layer_groups = layer_groups or [0] * num_layers
    caches: list[KVLayerCache | None] = [None] * num_layers
    for g, group in enumerate(plan.groups):
        layers = [i for i in range(num_layers) if layer_groups[i] == g]
        shape = (2, group.num_blocks + 1, plan.block_size, num_kv_heads)
        values = torch.empty((len(layers), *shape, head_dim), dtype=fmt.storage or dtype, device=device)
        scales = torch.empty((len(layers), *shape), dtype=SCALE_DTYPE, device=device) if fmt.quantized else None
        for j, layer in enumerate(layers):
            caches[layer] = KVLayerCache(values[j], None if scales is None else scales[j], fmt, g)
    return caches
