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
class KVCachePlan:
    num_blocks: int
    block_size: int
    bytes_per_token: int
    kv_dtype: str = "auto"
    scaled: bool = False

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def total_bytes(self) -> int:
        """What the cache tensors take: the requests' blocks and the null block."""
        return (self.num_blocks + 1) * self.block_size * self.bytes_per_token

    def describe(self) -> str:
        return (f"KV cache ({self.kv_dtype}): {self.num_blocks} blocks (+ the null block) x {self.block_size} tokens = "
                f"{self.num_tokens} tokens, {self.bytes_per_token} bytes/token "
                f"(2 x layers x kv_heads x (head_dim x dtype bytes{' + scale' if self.scaled else ''})), "
                f"{self.total_bytes / 2**20:.1f} MiB")


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


def plan_kv_cache(bytes_per_token: int, block_size: int, device: torch.device,
                  kv_cache_memory: str | int | None, memory_fraction: float,
                  max_useful_tokens: int, num_blocks_override: int | None = None,
                  memory_utilization: float | None = None) -> KVCachePlan:
    """Blocks from an explicit budget; or, with memory_utilization (vLLM's gpu_memory_utilization),
    from that fraction of the device's memory less what the process already holds (the weights);
    or from a fraction of free memory capped at what max_num_seqs sequences of max_model_len tokens
    could ever use."""
    bytes_per_block = bytes_per_token * block_size
    if num_blocks_override is not None:
        return KVCachePlan(num_blocks_override, block_size, bytes_per_token)
    if kv_cache_memory is not None:
        budget = parse_bytes(kv_cache_memory)
    elif memory_utilization is not None:
        held = process_memory(device)
        budget = int(total_memory(device) * memory_utilization) - held
        if budget < bytes_per_block:
            raise ValueError(f"gpu_memory_utilization {memory_utilization} of {total_memory(device) / 2**30:.1f} "
                             f"GiB leaves no room for the KV cache after the {held / 2**20:.0f} MiB this "
                             "process holds (the weights); raise it or pass --kv-cache-memory")
        budget = min(budget, -(-max_useful_tokens // block_size) * bytes_per_block)
    else:
        budget = int(available_memory(device) * memory_fraction)
        budget = min(budget, -(-max_useful_tokens // block_size) * bytes_per_block)
    num_blocks = budget // bytes_per_block
    if num_blocks < 1:
        raise ValueError(f"KV cache budget of {budget} bytes holds no block of {bytes_per_block} bytes;"
                         " raise --kv-cache-memory")
    return KVCachePlan(num_blocks, block_size, bytes_per_token)


def allocate_kv_cache(plan: KVCachePlan, num_layers: int, num_kv_heads: int, head_dim: int,
                      dtype: torch.dtype, device: torch.device,
                      fmt: KVFormat = KV_FORMATS["auto"]) -> list[KVLayerCache]:
    """plan.num_blocks blocks for requests and the null block (block 0: table padding), all
    uninitialised on purpose: zeroing gigabytes costs seconds at start (5.5 s for 5.7
    GiB on this CPU) and, on Linux, empty pages cost no memory until a block is first written. The
    model runner zeroes the null block at start and every other block on its first use.
    Every layer's cache is a view of one tensor [layers, 2, blocks, ...] (and the scales of another),
    so a block is zeroed in all layers at once (attention/kv_layer_cache.py, block_fills)."""
    shape = (2, plan.num_blocks + 1, plan.block_size, num_kv_heads)
    values = torch.empty((num_layers, *shape, head_dim), dtype=fmt.storage or dtype, device=device)
    scales = torch.empty((num_layers, *shape), dtype=SCALE_DTYPE, device=device) if fmt.quantized else None
    return [KVLayerCache(values[i], None if scales is None else scales[i], fmt) for i in range(num_layers)]
