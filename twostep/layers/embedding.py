"""The token embedding: a float table through F.embedding (a bf16 one widened to a float32 model's
dtype), or a quantized one (a GGUF file's
Q8_0 table, a tied head under --quantization) of which only the rows looked up are dequantized,
by the platform's quantized method (layers/dispatch.py binds it)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from twostep.quantization.packed import QuantizedWeight


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim))
        self.quantized: QuantizedWeight | None = None
        self.method = None              # the platform's quantized method, with quantized
        self.dtype: torch.dtype | None = None   # what a lookup returns, set at load (layers/dispatch.py)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:
            return self.method.embed(self.quantized, ids, self.dtype)
        rows = F.embedding(ids, self.weight)
        # a table narrowed to bf16 under a float32 model (a tied head's, platforms/cpu/bf16_weights.py)
        return rows if self.dtype is None or rows.dtype == self.dtype else rows.to(self.dtype)

    def extra_repr(self) -> str:
        kind = "" if self.quantized is None else f", quantized={'+'.join(self.quantized.format_names)}"
        return f"{self.num_embeddings}, {self.embedding_dim}{kind}"
