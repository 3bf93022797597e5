"""The KV cache's tensors: every layer a view of one tensor, so a block is zeroed in all layers with
one fill (the model runner zeroes each block on its first use; the cache is allocated
uninitialised)."""
from __future__ import annotations

import pytest
import torch

from twostep.attention.kv_layer_cache import KVLayerCache, block_fills
from twostep.config.kv_cache_dtype import KV_FORMATS
from twostep.kv.cache_tensors import KVCachePlan, KVGroupPlan, allocate_kv_cache

LAYERS, BLOCKS = 5, 9


def garbage(caches: list[KVLayerCache]) -> None:
    """Every byte 0xFF: NaN in float formats, -1 in int8."""
    for c in caches:
        c.raw_values.view(torch.uint8).fill_(0xFF)
        if c.scales is not None:
            c.scales.view(torch.uint8).fill_(0xFF)


def zero(caches: list[KVLayerCache], blocks: list[int]) -> None:
    for tensor, dim in block_fills(caches):
        tensor.index_fill_(dim, torch.tensor(blocks), 0)


def assert_zeroed_exactly(caches: list[KVLayerCache], blocks: list[int]) -> None:
    for c in caches:
        for part in (c.raw_values, c.scales):
            if part is None:
                continue
            as_bytes = part.view(torch.uint8) if part.dtype != torch.uint8 else part
            for b in range(BLOCKS + 1):
                expected = 0 if b in blocks else 0xFF
                assert bool((as_bytes[:, b] == expected).all()), (c.fmt.name, b)


@pytest.mark.parametrize("fmt", ["auto", "int8", "fp8_e4m3", "fp8_e5m2"])
def test_one_fill_zeroes_a_block_in_every_layer(fmt):
    caches = allocate_kv_cache(KVCachePlan(4, (KVGroupPlan(LAYERS, 0, BLOCKS),)), LAYERS, 2, 8, torch.bfloat16, torch.device("cpu"),
                               KV_FORMATS[fmt])
    fills = block_fills(caches)
    assert len(fills) == (2 if KV_FORMATS[fmt].quantized else 1)      # the values (and scales): one each
    assert all(dim == 2 and t.shape[0] == LAYERS for t, dim in fills)
    garbage(caches)
    zero(caches, [0, 3, 7])
    assert_zeroed_exactly(caches, [0, 3, 7])


def test_layers_allocated_apart_are_zeroed_one_by_one():
    caches = [KVLayerCache(torch.empty(2, BLOCKS + 1, 4, 2, 8, dtype=torch.float8_e4m3fn),
                           torch.empty(2, BLOCKS + 1, 4, 2, dtype=torch.bfloat16), KV_FORMATS["fp8_e4m3"])
              for _ in range(LAYERS)]
    fills = block_fills(caches)
    assert len(fills) == 2 * LAYERS and all(dim == 1 for _, dim in fills)
    garbage(caches)
    zero(caches, [2, 9])
    assert_zeroed_exactly(caches, [2, 9])
    # views of one tensor in another order are not taken for it either
    whole = torch.empty(LAYERS, 2, BLOCKS + 1, 4, 2, 8)
    shuffled = [KVLayerCache(whole[i], None, KV_FORMATS["auto"]) for i in reversed(range(LAYERS))]
    assert len(block_fills(shuffled)) == LAYERS
