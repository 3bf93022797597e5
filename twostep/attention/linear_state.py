"""A linear-attention layer's cache and a step's layout of it: the counterpart of KVLayerCache and
AttentionMetadata for the layers that keep a state per sequence (kv/state_slots.py) instead of K/V.

Every such layer's states are views of two tensors [layers, slots + 1, ...] (slot 0: never held),
so the model runner starts, restores and saves a sequence's state in every layer with one copy."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from twostep.attention.metadata import int64_tensor


@dataclass(slots=True)
class LinearStateCache:
    """One layer's states: conv [slots + 1, kernel - 1, channels] (the convolution's last inputs, the
    model's dtype) and recurrent [slots + 1, value heads, Dk, Dv] (float32)."""

    conv: torch.Tensor
    recurrent: torch.Tensor
    group: int                   # where the step's StateMetadata sits among the metadata
    # a verification step's states after each of a sequence's tokens (sequence -> (conv, recurrent)
    # [tokens, ...]): the runner keeps the one of the last accepted token
    verified: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


@dataclass(slots=True)
class StateMetadata:
    """Where each sequence's tokens sit in the flat batch, its live slot, and how the step runs it."""

    query_start_loc: list[int]
    query_lens: list[int]
    slots: list[int]
    decodes: list[int]            # one token, no drafts: one batched recurrent step
    decode_slots: torch.Tensor    # their slots
    decode_rows: torch.Tensor | None   # their rows in the flat batch (None: every row is one)
    prompts: list[int]            # prompt chunks: the chunked rule
    verifies: list[int]           # drafts to verify: a recurrent step per token, each state kept
    # sequence -> ((after how many of its tokens, the slot to save the state into), ...), in order
    saves: dict[int, tuple[tuple[int, int], ...]]

    @staticmethod
    def build(query_start_loc: list[int], query_lens: list[int], slots: list[int], num_drafts: list[int],
              saves: dict[int, tuple[tuple[int, int], ...]], device: torch.device) -> "StateMetadata":
        decodes = [i for i, (n, d) in enumerate(zip(query_lens, num_drafts)) if n == 1 and not d]
        verifies = [i for i, d in enumerate(num_drafts) if d]
        prompts = [i for i, (n, d) in enumerate(zip(query_lens, num_drafts)) if n > 1 and not d]
        rows = None if len(decodes) == query_start_loc[-1] else int64_tensor([query_start_loc[i] for i in decodes],
                                                                               device)
        return StateMetadata(query_start_loc, query_lens, slots, decodes,
                             int64_tensor([slots[i] for i in decodes], device), rows, prompts, verifies, saves)


def allocate_state_cache(num_layers: int, num_slots: int, kernel: int, channels: int, heads: int,
                         key_dim: int, value_dim: int, dtype: torch.dtype, device: torch.device,
                         group: int) -> tuple[list[LinearStateCache], torch.Tensor, torch.Tensor]:
    """Every linear-attention layer's states, zeroed (a fresh sequence's slot is zeroed again
    when it starts); also the two whole tensors."""
    conv = torch.zeros(num_layers, num_slots + 1, kernel - 1, channels, dtype=dtype, device=device)
    recurrent = torch.zeros(num_layers, num_slots + 1, heads, key_dim, value_dim, dtype=torch.float32,
                            device=device)
    return [LinearStateCache(conv[i], recurrent[i], group) for i in range(num_layers)], conv, recurrent
