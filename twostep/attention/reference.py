"""Attention in pure PyTorch; runs on any device and is what the exactness tests hold to.

Decodes (and their drafts) are batched into two float32 matmuls over blocks gathered with one
index_select, padded to the longest context and masked; each prefill chunk gets its own SDPA call
with a causal mask offset by its cached prefix (a chunk at offset s: query i sees keys at
positions <= s + i, and with a sliding window only the last `window` of them); soft-capping and
sinks, which SDPA lacks, take the same math written out (_eager)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from twostep.attention.kv_layer_cache import KVLayerCache, dequantize
from twostep.attention.metadata import AttentionMetadata, DecodeRows, blocks_for
from twostep.attention.options import AttentionOptions


@dataclass(slots=True)
class ReferenceDecodePlan:
    rows: DecodeRows
    tables: torch.Tensor             # [B, blocks covering max_len]
    max_len: int
    last: torch.Tensor               # [B, Q]: each query's position (the last key it sees)
    # what each query may see [B, 1, Q, max_len], by window (None: every earlier position), made on
    # first use; None where nothing is hidden (Q = 1, every context as long, no window)
    masks: dict[int | None, torch.Tensor | None] = field(default_factory=dict)
    plain: bool = False              # Q = 1 and every context has the same length

    def mask(self, window: int | None) -> torch.Tensor | None:
        if window not in self.masks:
            hidden = self.plain and (window is None or window >= self.max_len)
            self.masks[window] = None if hidden else visible(self.last, self.max_len, window)[:, None]
        return self.masks[window]


class ReferenceDecode:
    """A few queries per sequence: two batched matmuls over the gathered context (cheaper than
    SDPA's kernels for so few queries), all in float32. Padding positions hold finite values (the
    runner zeroes a block on first use; table padding is the zeroed null block) and are masked, as
    are keys after a query's own position and before its window."""

    def build(self, common: AttentionMetadata, rows: list[int]) -> ReferenceDecodePlan:
        device = common.block_tables.device
        lens = [common.seq_lens[r] for r in rows]
        qlens = [common.query_lens[r] for r in rows]
        max_len, max_q = max(lens), max(qlens)
        # query i of a sequence with q new tokens and context n sits at n - q + i
        last = torch.tensor([n - q for n, q in zip(lens, qlens)], device=device)[:, None] \
            + torch.arange(max_q, device=device)[None, :]
        tables = common.block_tables[rows, : blocks_for(max_len, common.block_size)]
        return ReferenceDecodePlan(DecodeRows.build(common, rows), tables, max_len, last,
                                   plain=max_q == 1 and min(lens) == max_len)

    def forward(self, q: torch.Tensor, kv_cache: KVLayerCache, plan: ReferenceDecodePlan,
                options: AttentionOptions, out: torch.Tensor) -> None:
        keys, values = gather(kv_cache, plan.tables, plan.max_len, q.dtype)  # [B, L, Hkv, D]
        (b, nq), kv_heads, dim = plan.rows.index.shape, keys.shape[2], keys.shape[3]
        group = q.shape[1] // kv_heads
        queries = q[plan.rows.index.reshape(-1)].float().view(b, nq, kv_heads, group, dim)
        queries = queries.permute(0, 2, 3, 1, 4).reshape(b, kv_heads, group * nq, dim)  # rows (g, i)
        k = _heads_first(keys, torch.float32)                          # [B, Hkv, L, D]
        scores = softcapped(torch.matmul(queries, k.transpose(-1, -2)) * options.scale, options.softcap)
        mask = plan.mask(options.window)
        if mask is not None:
            scores.masked_fill_(~mask.repeat(1, 1, group, 1), float("-inf"))
        sinks = None if options.sinks is None else \
            options.sinks.view(1, kv_heads, group, 1).expand(b, kv_heads, group, nq).reshape(b, kv_heads, -1)
        probs = softmax_with_sinks(scores, sinks)
        o = torch.matmul(probs, _heads_first(values, torch.float32))  # [B, Hkv, G*Q, D]
        plan.rows.scatter(out, o.view(b, kv_heads, group, nq, dim).permute(0, 3, 1, 2, 4)
                          .reshape(b * nq, -1, dim))


class ReferencePrefill:
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVLayerCache,
                common: AttentionMetadata, row: int, options: AttentionOptions, out: torch.Tensor) -> None:
        start, qlen, slen = common.query_start_loc[row], common.query_lens[row], common.seq_lens[row]
        queries = q[start:start + qlen].transpose(0, 1).unsqueeze(0)   # [1, H, q, D]
        # Nothing cached before this chunk: attend to its own K/V. With 8-bit KV, read them back
        # from the cache instead, so every query sees the same (quantised) K/V whatever the
        # chunking, prefix-cache hits or preemptions: outputs stay independent of scheduling.
        if slen == qlen and kv_cache.scales is None:
            keys, values = k[start:start + qlen][None], v[start:start + qlen][None]
        else:
            table = common.block_tables[row: row + 1, : blocks_for(slen, common.block_size)]
            keys, values = gather(kv_cache, table, slen, q.dtype)
        mask = None
        if slen != qlen or (options.window is not None and options.window < slen):
            # query i sits at position (slen - qlen + i)
            mask = visible(torch.arange(slen - qlen, slen, device=q.device)[None], slen, options.window)[:, None]
        if options.softcap is None and options.sinks is None:
            o = _sdpa(queries, keys, values, mask, options.scale, causal=mask is None)
        else:
            o = _eager(queries, keys, values, mask, options)
        out[start:start + qlen] = o[0].transpose(0, 1).to(out.dtype)


def visible(last: torch.Tensor, length: int, window: int | None) -> torch.Tensor:
    """[B, Q] query positions -> [B, Q, length]: which key positions each query sees."""
    keys = torch.arange(length, device=last.device)[None, None, :]
    seen = keys <= last[:, :, None]
    if window is not None:
        seen &= keys > last[:, :, None] - window
    return seen


def softcapped(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    return scores if softcap is None else torch.tanh(scores / softcap) * softcap


def softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """softmax over the last dim; sinks [..., rows] (one logit per row) join each denominator only."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    return torch.softmax(torch.cat([scores, sinks[..., None]], dim=-1), dim=-1)[..., :-1]


def gather(cache: KVLayerCache, tables: torch.Tensor, length: int, dtype: torch.dtype):
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


def _eager(q, keys, values, mask, options: AttentionOptions) -> torch.Tensor:
    """What SDPA computes, with the variants it lacks (soft-capping, sinks), in float32."""
    b, heads, n, _ = q.shape
    group = heads // keys.shape[2]
    keys = keys.transpose(1, 2).float().repeat_interleave(group, dim=1)
    values = values.transpose(1, 2).float().repeat_interleave(group, dim=1)
    scores = softcapped(torch.matmul(q.float(), keys.transpose(-1, -2)) * options.scale, options.softcap)
    if mask is not None:
        scores.masked_fill_(~mask, float("-inf"))
    elif n > 1:
        scores.masked_fill_(~visible(torch.arange(n, device=q.device)[None], n, None)[:, None], float("-inf"))
    sinks = None if options.sinks is None else options.sinks.view(1, heads, 1).expand(b, heads, n)
    return torch.matmul(softmax_with_sinks(scores, sinks), values).to(q.dtype)


def _sdpa(q, keys, values, mask, scale, causal: bool = False) -> torch.Tensor:
    """q [B, H, q, D]; keys/values [B, L, Hkv, D]; grouped heads share their K/V head."""
    keys, values = keys.transpose(1, 2).to(q.dtype), values.transpose(1, 2).to(q.dtype)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=causal,
                                          scale=scale, enable_gqa=keys.shape[1] != q.shape[1])
