"""Attention over the paged KV cache for one flat, mixed batch.

The batch is a concatenation of sequences without padding. Sequence i contributes
query_lens[i] new tokens that sit at the end of its context of seq_lens[i] tokens:
a decode has query_len 1, a prefill chunk starting at any offset has more. Every new
token's K/V is written to its slot (slot_mapping) first, then each query attends to
every cached position up to and including its own.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from twostep.layers.kv_storage import KVLayerCache, dequantize, quantize


@dataclass(slots=True)
class AttentionMetadata:
    """Built once per step by the model runner; shared by every layer."""

    query_start_loc: list[int]       # [B+1] offsets of each sequence's tokens in the flat batch
    query_lens: list[int]            # [B]
    seq_lens: list[int]              # [B] context length after this step (cached + new)
    slot_mapping: torch.Tensor       # [T] int64: block_id * block_size + offset for each new token
    block_tables: torch.Tensor       # [B, max_blocks] int64, padded with 0
    block_size: int
    prefill_rows: list[int]          # prompt chunks: one attention call each
    decode: "DecodeBatch | None" = None  # decodes (with any drafts to verify), batched together


@dataclass(slots=True)
class DecodeBatch:
    """Sequences with a few new tokens each (a decode, or a decode verifying k drafts), batched
    into one attention call per layer; built once per step (not once per layer)."""

    index: torch.Tensor              # [B, Q] flat positions of each sequence's new tokens (padded
                                     # with its last one), Q = the most new tokens of any of them
    tables: torch.Tensor             # [B, blocks covering max_len]
    max_len: int
    mask: torch.Tensor | None        # [B, 1, Q, max_len]: what each query may see; None when
                                     # Q = 1 and every context has the same length
    valid: torch.Tensor | None       # [B * Q] which rows of index are real tokens; None: all
    query_lens: torch.Tensor         # [B] new tokens of each sequence (int64)
    seq_lens: torch.Tensor           # [B] its context after this step (int64)

    def scatter(self, out: torch.Tensor, o: torch.Tensor) -> None:
        """Write per-query results o [B * Q, H, D] to the queries' rows of out, padding dropped."""
        index = self.index.reshape(-1)
        if self.valid is not None:
            o, index = o[self.valid], index[self.valid]
        out[index] = o.to(out.dtype)

    @staticmethod
    def build(rows: list[int], starts: list[int], query_lens: list[int], seq_lens: list[int],
              block_tables: torch.Tensor, block_size: int) -> "DecodeBatch":
        device = block_tables.device
        lens = [seq_lens[r] for r in rows]
        qlens = [query_lens[r] for r in rows]
        max_len, max_q = max(lens), max(qlens)
        index = torch.tensor([[starts[r] + min(i, q - 1) for i in range(max_q)]
                              for r, q in zip(rows, qlens)], device=device)
        mask = valid = None
        if max_q > 1 or min(lens) != max_len:
            # query i of a sequence with q new tokens and context n sits at n - q + i
            last = torch.tensor([n - q for n, q in zip(lens, qlens)], device=device)[:, None] \
                + torch.arange(max_q, device=device)[None, :]
            mask = (torch.arange(max_len, device=device)[None, None, :] <= last[:, :, None])[:, None]
        if min(qlens) != max_q:
            valid = (torch.arange(max_q, device=device)[None, :]
                     < torch.tensor(qlens, device=device)[:, None]).reshape(-1)
        return DecodeBatch(index, block_tables[rows, : _blocks_for(max_len, block_size)], max_len,
                           mask, valid, torch.tensor(qlens, device=device), torch.tensor(lens, device=device))


class AttentionBackend(Protocol):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: KVLayerCache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D], kv_cache: one layer's KVLayerCache -> [T, H, D]."""
        ...


def write_kv(cache: KVLayerCache, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """Store the new tokens' K and V at their slots (quantised first for 8-bit formats)."""
    num_blocks, block_size, heads, dim = cache.values.shape[1:]
    flat = cache.values.view(2, num_blocks * block_size, heads, dim)
    if cache.scales is None:
        flat[0].index_copy_(0, slots, k.to(flat.dtype))
        flat[1].index_copy_(0, slots, v.to(flat.dtype))
        return
    raw = cache.raw_values.view(2, num_blocks * block_size, heads, dim)
    scales = cache.scales.view(2, num_blocks * block_size, heads)
    for i, x in enumerate((k, v)):
        q, scale = quantize(x, cache.fmt)
        raw[i].index_copy_(0, slots, q.view(raw.dtype))
        scales[i].index_copy_(0, slots, scale)


class ReferenceAttention:
    """Pure PyTorch; runs on any device. Decodes (and their drafts) are batched into one padded
    call; each prefill chunk gets its own SDPA call with a causal mask offset by its cached prefix."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: KVLayerCache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        write_kv(kv_cache, k, v, meta.slot_mapping)
        out = torch.empty_like(q)
        if meta.decode is not None:
            self._decode(q, kv_cache, meta.decode, scale, out)
        for row in meta.prefill_rows:
            self._prefill(q, k, v, kv_cache, meta, row, scale, out)
        return out

    def _decode(self, q, kv_cache, d: DecodeBatch, scale, out) -> None:
        """A few queries per sequence: two batched matmuls over the gathered context (cheaper
        than SDPA's kernels for so few queries), all in float32. Padding
        positions hold finite values (see ModelRunner: blocks are zeroed on first use) and are
        masked, as are keys after a query's own position."""
        keys, values = _gather(kv_cache, d.tables, d.max_len, q.dtype)  # [B, L, Hkv, D]
        (b, nq), kv_heads, dim = d.index.shape, keys.shape[2], keys.shape[3]
        group = q.shape[1] // kv_heads
        queries = q[d.index.reshape(-1)].float().view(b, nq, kv_heads, group, dim)
        queries = queries.permute(0, 2, 3, 1, 4).reshape(b, kv_heads, group * nq, dim)  # rows (g, i)
        k = _heads_first(keys, torch.float32)                          # [B, Hkv, L, D]
        scores = torch.matmul(queries, k.transpose(-1, -2)) * scale    # [B, Hkv, G*Q, L]
        if d.mask is not None:
            scores.masked_fill_(~d.mask.repeat(1, 1, group, 1), float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        o = torch.matmul(probs, _heads_first(values, torch.float32))  # [B, Hkv, G*Q, D]
        d.scatter(out, o.view(b, kv_heads, group, nq, dim).permute(0, 3, 1, 2, 4).reshape(b * nq, -1, dim))

    def _prefill(self, q, k, v, kv_cache, meta, row, scale, out) -> None:
        start, qlen, slen = meta.query_start_loc[row], meta.query_lens[row], meta.seq_lens[row]
        queries = q[start:start + qlen].transpose(0, 1).unsqueeze(0)   # [1, H, q, D]
        # Nothing cached before this chunk: attend to its own K/V. With 8-bit KV, read them back
        # from the cache instead, so every query sees the same (quantised) K/V whatever the
        # chunking, prefix-cache hits or preemptions: outputs stay independent of scheduling.
        if slen == qlen and kv_cache.scales is None:
            keys, values = k[start:start + qlen][None], v[start:start + qlen][None]
            mask = None
        else:
            table = meta.block_tables[row: row + 1, : _blocks_for(slen, meta.block_size)]
            keys, values = _gather(kv_cache, table, slen, q.dtype)
            # query i sits at position (slen - qlen + i) and sees keys at positions <= that
            qpos = torch.arange(slen - qlen, slen, device=q.device)
            mask = (torch.arange(slen, device=q.device)[None, :] <= qpos[:, None])[None, None]
        o = _sdpa(queries, keys, values, mask, scale, causal=mask is None)
        out[start:start + qlen] = o[0].transpose(0, 1).to(out.dtype)


def _blocks_for(num_tokens: int, block_size: int) -> int:
    return (num_tokens + block_size - 1) // block_size


def _gather(cache: KVLayerCache, tables: torch.Tensor, length: int, dtype: torch.dtype):
    """Block tables [B, n] -> contiguous keys and values [B, length, Hkv, D] in dtype."""
    b, n = tables.shape
    _, _, bs, h, d = cache.values.shape
    index = tables.reshape(-1)
    blocks = torch.index_select(cache.values, 1, index).view(2, b, n * bs, h, d)[:, :, :length]
    if cache.scales is not None:
        scales = torch.index_select(cache.scales, 1, index).view(2, b, n * bs, h)[:, :, :length]
        blocks = dequantize(blocks, scales, dtype)
    return blocks[0], blocks[1]


def _heads_first(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, L, H, D] -> contiguous [B, H, L, D] in dtype, in one copy."""
    b, length, h, d = x.shape
    out = torch.empty((b, h, length, d), dtype=dtype, device=x.device)
    out.copy_(x.permute(0, 2, 1, 3))
    return out


def _sdpa(q, keys, values, mask, scale, causal: bool = False) -> torch.Tensor:
    """q [B, H, q, D]; keys/values [B, L, Hkv, D]; grouped heads share their K/V head."""
    keys, values = keys.transpose(1, 2).to(q.dtype), values.transpose(1, 2).to(q.dtype)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=causal,
                                          scale=scale, enable_gqa=keys.shape[1] != q.shape[1])


def get_attention_backend(name: str = "auto", device: torch.device | None = None) -> AttentionBackend:
    """auto: the C++ paged kernel for decodes on CPU where it builds, else the reference backend."""
    if name in ("auto", "cpu_paged") and (device is None or device.type == "cpu"):
        from twostep.kernels import paged_attention
        from twostep.layers.cpu_paged_attention import CPUPagedAttention

        kernel = paged_attention()
        if kernel is not None:
            return CPUPagedAttention(kernel)
        if name == "cpu_paged":
            raise ValueError("attention backend cpu_paged: its C++ kernel could not be built (see the log)")
    if name in ("auto", "reference"):
        return ReferenceAttention()
    raise ValueError(f"unknown attention backend {name!r}: available: auto, reference, cpu_paged")
