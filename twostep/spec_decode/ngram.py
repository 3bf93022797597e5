"""Prompt lookup: propose what followed the latest earlier occurrence of the sequence's last
n tokens (n from prompt_lookup_max down to prompt_lookup_min), in its prompt and output so
far. Costs no model forward; pays off when the output copies from the input (editing,
summarising with quotes, code, retrieval-grounded answers)."""
from __future__ import annotations

import numpy as np

from twostep.core.scheduling.request import Request
from twostep.config import SpeculativeConfig


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(self, requests: list[Request], ks: list[int]) -> list[tuple[list[int], None]]:
        """Up to ks[i] drafts for requests[i]; n-gram drafts are point masses (no distribution)."""
        return [(self.lookup(r.all_token_ids, k), None) for r, k in zip(requests, ks)]

    def lookup(self, token_ids: list[int], k: int) -> list[int]:
        """Up to k draft tokens continuing token_ids, or [] when no n-gram recurs."""
        if k < 1 or len(token_ids) <= self.min_n:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            start = self._latest_match(tokens, n, k)
            if start is not None:
                return tokens[start + n:start + n + k].tolist()
        return []

    @staticmethod
    def _latest_match(tokens: np.ndarray, n: int, k: int) -> int | None:
        """Start of the latest earlier occurrence of the last n tokens, preferring one that
        k known tokens follow (a match near the end has a short continuation)."""
        suffix = tokens[-n:]
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)  # not the suffix itself
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if not hits.size:
            return None
        full = hits[hits + n + k <= len(tokens)]
        return int(full[-1] if full.size else hits[-1])

    def remove(self, request_id: str) -> None:
        """Nothing is held per request."""
