"""Quantized linears and embeddings on CPU, on twostep/kernels/quant_linear.cpp.

A few rows (decode) take the kernel's matrix-vector product, which streams each packed weight
block once against activations quantized per block to int16 (llama.cpp's int8 multiplies faster
but is ~0.5% off, enough to flip a close top token) and writes its float32 sums in the
activations' dtype. More rows (prefill, large decode batches) dequantize the weight a tile of rows
at a time into the model's dtype and multiply with oneDNN / MKL, so prefill runs at the float
matmul's rate plus the dequantisation, which those rows share. An embedding dequantizes only the
rows it looks up.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from twostep import kernels
from twostep.quantization.packed import PackedWeight, QuantizedWeight

GEMV_ROWS = 8              # rows the matrix-vector kernel takes in one pass over the weights
GEMV_MAX_ROWS = 32         # up to this many rows, passes of GEMV_ROWS beat dequantized tiles (measured)
TILE_BYTES = 4 << 20       # the dequantized tile a matrix-matrix product multiplies at once


class QuantizedLinearMethod:
    """A LinearMethod (layers/linear.py) for layers whose weight is a QuantizedWeight
    (layer.quantized); the layer keeps no float weight."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        self.name = f"quantized ({kernel.path()} kernel)"

    def process_weights(self, layer) -> None:
        layer.weight = None
        layer.plain_bias = None if layer.bias is None else layer.bias.detach()
        parts = layer.quantized.parts
        # the kernel's arguments for a one-part weight, so a decode step's call is one C++ call
        layer.gemv_args = (*parts[0].planes(), *_format_args(parts[0])) if len(parts) == 1 else None

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        if layer.gemv_args is not None and x.dim() == 2 and x.shape[0] <= GEMV_ROWS and x.is_contiguous():
            y = torch.empty(x.shape[0], layer.out_features, dtype=x.dtype)
            self.kernel.gemv(x, *layer.gemv_args, y)          # batch-1 decode: the short way
        else:
            y = self.matmul(layer.quantized, x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], -1)
        if layer.plain_bias is not None:
            y = y + layer.plain_bias
        return y

    def fused(self, layer, kernel):
        """Up to GEMV_ROWS rows: one quant_gemv per part into its columns, as apply() and _gemv().
        The stack calls the op twostep::quant_gemv, which only the platform's build registers (the
        portable build's is twostep_portable::): any other kernel is not fused."""
        if self.kernel is not kernels.quant_linear():
            return None
        linear = kernel.FusedLinear(layer.out_features, layer.plain_bias)
        for part in layer.quantized.parts:
            linear.add_quantized(*part.planes(), *_format_args(part))
        return linear, GEMV_ROWS

    def matmul(self, weight: QuantizedWeight, x: torch.Tensor) -> torch.Tensor:
        """x [m, k] @ weight^T -> [m, n] in x's dtype."""
        if x.shape[0] <= GEMV_MAX_ROWS:
            return self._gemv(weight, x.contiguous())
        return self._tiled(weight, x)

    def _gemv(self, weight: QuantizedWeight, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty(x.shape[0], weight.n, dtype=x.dtype)
        for first in range(0, x.shape[0], GEMV_ROWS):
            rows = slice(first, first + GEMV_ROWS)
            start = 0
            for part in weight.parts:
                self.kernel.gemv(x[rows], *part.planes(), *_format_args(part), out[rows, start:start + part.n])
                start += part.n
        return out

    def _tiled(self, weight: QuantizedWeight, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty(x.shape[0], weight.n, dtype=x.dtype)
        start = 0
        for part in weight.parts:
            rows = max(16, TILE_BYTES // (part.k * x.element_size()))
            for first in range(0, part.n, rows):
                ids = torch.arange(first, min(first + rows, part.n))
                tile = self.dequantize(part, ids, x.dtype)
                out[:, start + first:start + first + ids.numel()] = F.linear(x, tile)
            start += part.n
        return out

    def dequantize(self, part: PackedWeight, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        tile = torch.empty(ids.numel(), part.k, dtype=dtype)
        self.kernel.dequantize_rows(*part.planes(), *_format_args(part), ids, tile)
        return tile

    def embed(self, weight: QuantizedWeight, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` of a quantized embedding table, in dtype."""
        flat = ids.reshape(-1).to(torch.int64)
        if len(weight.parts) == 1:
            rows = self.dequantize(weight.parts[0], flat.contiguous(), dtype)
        else:
            rows = weight.dequantize(dtype)[flat]       # a table is one format in practice
        return rows.view(*ids.shape, weight.k)


def _format_args(part: PackedWeight) -> tuple[int, int, int]:
    return part.fmt.bits, part.fmt.group, part.fmt.zero
