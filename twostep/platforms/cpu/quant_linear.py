"""Quantized linears and embeddings on CPU, on twostep/kernels/csrc/quant/. Which product a
call takes, by the rows of its input:

- **A few rows (decode)**: the matrix-vector passes, which stream each packed weight block once
  against activations quantized per block to int16 (the float product of the dequantized weights
  within float rounding). Where the build has it, a weight of a multiple of 8 rows is bound in the
  panel layout (quantization/packed.py): eight rows interleaved, so a vector holds eight output
  columns and needs no horizontal sums.
- **More rows (prefill, large batches)** against the panel layout: bf16 rows through `gemm_bf16`
  where the CPU computes bf16 (AVX512-BF16 or AMX), float32 rows through `gemm_f32` where torch's
  float brgemm runs. Each thread dequantizes 64 weight rows at a time into a buffer in its L2 cache,
  in the layout oneDNN's brgemm multiplies, and runs every row against it: the weights never make a
  trip through memory in float. Other dtypes and layouts dequantize a tile of rows at a time and
  multiply with oneDNN / MKL. The crossovers between passes and GEMMs below were measured per build
  (benchmarks/RESULTS.md); AVX-512 builds keep their 8-row passes up to 32 float32 rows, their
  crossover with gemm_f32 not measured.
- An embedding dequantizes only the rows it looks up.

**int8 activations** (--cpu-int8-activations): the int8 product instead, activations quantized per
block of 32 to int8 as llama.cpp quantizes them, for 4 to 6-bit codes (8-bit too with VNNI: AVX2's
vpmaddubsw cannot take a whole byte against int8 without a second multiply, which costs what the
int16 passes cost). From int8_min_rows() rows: 1 in the panel layout (a small-row kernel), else 8.
Each row's sums are the same bits whatever the rows beside it. Its rounding (a step of max|x| / 127
per block) is noise enough to flip a close top token: in a prompt's rows it turns the default
SmolLM2 file's answer to "What is the capital of France?" into "L'Étoile, ...". So the mode says where
it applies:
  decode (the default): the steps of a decode batch (platforms/step_kind.py: every row one
    sequence's next token or a draft it verifies), the lm_head's logits too, in any dtype: decode at
    llama.cpp's precision and speed, a row's logits the same whatever the batch; a prompt's forward
    (its last token too) keeps the int16 activations;
  all: every input from int8_min_rows() rows, prompts too (the fastest prefill);
  off: never.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from twostep import kernels
from twostep.config.engine import INT8_ACTIVATION_MODES
from twostep.platforms.cpu.huge_pages import HugePageArena
from twostep.platforms.step_kind import in_decode_batch
from twostep.quantization.packed import PackedWeight, QuantizedWeight

GEMV_ROWS = 8              # rows the matrix-vector kernel takes in one call in the row layout (the
                           # panel layout: kernel.panel_call_rows(), all of a step's passes in one)
INT8_TILE_ROWS = 8         # the int8 product's rows without its small-row kernel (the row layout)
GEMV_MAX_ROWS = 32         # up to this many rows, passes of GEMV_ROWS beat dequantized tiles (measured)
# the same for 16-bit activations with the 8-row pass of AVX-512 builds, by code width (Qwen2.5-0.5B-
# shape linears, bf16, Zen 4: at 64 rows the passes are 1.02-1.13x the tiles for 4 and 8 bits, 0.93x
# for 5, 0.82x for 6). Float32 activations keep 32: their tiles are float32 math, which the exactness
# tests against transformers hold a whole prompt to, where the passes' int16 activations are not.
WIDE_GEMV_MAX_ROWS = {4: 64, 5: 48, 6: 32, 8: 64}
# ... and for bf16 activations where the kernel has gemm_bf16 (the same linears, Zen 4: gemm_bf16
# is 0.93-1.05x the passes at 16 rows, 1.1-1.5x at 24, 1.2-1.4x at 32, 1.6-1.8x at 64)
BF16_GEMM_GEMV_MAX_ROWS = 16
# ... and for float32 activations where the kernel has gemm_f32 (AVX2 CPUs), by code width (the same
# linears, Zen 1: gemm_f32 1.01-1.22x the passes at 8 rows for 4 to 6-bit codes, 1.26-1.49x at 16,
# 2026-12-05; 8-bit codes, whose passes need no decoding and take two chunks a load, 0.70x at 8,
# 0.83x at 12, 0.89x at 16, 1.00x at 24, 1.05x at 32, against the passes in one call, 2026-12-06);
# float32 math, which the passes' int16 activations are not
F32_GEMM_GEMV_MAX_ROWS = {4: 8, 5: 8, 6: 8, 8: 16}
TILE_BYTES = 4 << 20       # the dequantized tile a matrix-matrix product multiplies at once


class QuantizedLinearMethod:
    """A LinearMethod (layers/linear.py) for layers whose weight is a QuantizedWeight
    (layer.quantized); the layer keeps no float weight."""

    def __init__(self, kernel, int8_activations: str = "off", arena: HugePageArena | None = None) -> None:
        """int8_activations: where the int8 product applies (above; the engine passes its
        --cpu-int8-activations, whose default is decode; "off" here, for a method built by hand).
        arena: where prepared weights are placed (huge pages), or None: where packing left them."""
        if int8_activations not in INT8_ACTIVATION_MODES:
            raise ValueError(f"int8 activations: one of {', '.join(INT8_ACTIVATION_MODES)}; got {int8_activations!r}")
        self.kernel, self.arena = kernel, arena
        self.int8_mode = int8_activations if kernel.has_int8() else "off"
        self.int8_bits = frozenset(kernel.int8_bits()) if self.int8_mode != "off" else frozenset()   # code widths it takes
        self.int8_rows = kernel.int8_min_rows()   # 1 where the small-row kernel is (the panel layout), else 8
        self.wide_pass = kernel.wide_pass()     # the build's 8-row pass: more rows in passes (below)
        self.panel_call_rows = kernel.panel_call_rows()   # rows one call of the panel layout's passes takes
        self.bf16_gemm = kernel.has_bf16_gemm()   # bf16 rows x the panel layout through brgemm
        # float32 rows x the panel layout through brgemm, past the passes' rows (in place of the
        # dequantized tiles, which make the weights' trip through memory twice)
        self.f32_gemm = kernel.has_f32_gemm()
        where = {"off": "", "decode": f", int8 activations in decode batches from {self.int8_rows} rows",
                 "all": f", int8 activations from {self.int8_rows} rows"}[self.int8_mode]
        self.name = f"quantized ({kernel.path()} kernel{where})"

    def int8_for(self, x: torch.Tensor) -> bool:
        """Whether x's rows take the int8 product (for the code widths it takes)."""
        if self.int8_mode == "off" or x.shape[0] < self.int8_rows:
            return False
        return self.int8_mode == "all" or in_decode_batch()

    def part_int8_rows(self, part: PackedWeight) -> int:
        """From how many rows a part takes the int8 product (0: never): the small-row kernel reads
        the panel layout only, so a row-layout part keeps the int16 passes below INT8_TILE_ROWS."""
        if part.fmt.bits not in self.int8_bits:
            return 0
        return self.int8_rows if part.panels else max(self.int8_rows, INT8_TILE_ROWS)

    def prepare(self, weight: QuantizedWeight) -> QuantizedWeight:
        """The layout this kernel multiplies fastest (the panel layout for the parts it fits), in
        the arena where there is one."""
        panels = self.kernel.has_panels()
        return QuantizedWeight(tuple(self._placed(self._panels(p) if panels and p.panel_layout_fits() else p)
                                     for p in weight.parts))

    def _placed(self, part: PackedWeight) -> PackedWeight:
        if self.arena is None:
            return part
        place = self.arena.place
        return dataclasses.replace(part, qs=place(part.qs), qh=place(part.qh), scales=place(part.scales),
                                   mins=place(part.mins))

    def _panels(self, part: PackedWeight) -> PackedWeight:
        qs, scales, mins = self.kernel.pack_panels(part.qs, part.qh, part.scales, part.mins, part.fmt.bits,
                                                   part.fmt.group, part.k)
        return dataclasses.replace(part, qs=qs, qh=None, scales=scales, mins=mins)

    def process_weights(self, layer) -> None:
        layer.weight = None
        layer.plain_bias = None if layer.bias is None else layer.bias.detach()
        parts = layer.quantized.parts
        # the kernel's arguments for a one-part weight, so a decode step's call is one C++ call
        layer.gemv_args = (*parts[0].planes(), *_format_args(parts[0])) if len(parts) == 1 else None
        layer.int8_from = self.part_int8_rows(parts[0]) if len(parts) == 1 else 0   # 0: never

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        if layer.gemv_args is not None and x.dim() == 2 and x.shape[0] <= GEMV_ROWS and x.is_contiguous():
            y = torch.empty(x.shape[0], layer.out_features, dtype=x.dtype)
            int8 = 0 < layer.int8_from <= x.shape[0] and self.int8_for(x)
            product = self.kernel.gemm_int8 if int8 else self.kernel.gemv
            product(x, *layer.gemv_args, y)          # batch-1 decode: the short way
        else:
            y = self.matmul(layer.quantized, x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], -1)
        if layer.plain_bias is not None:
            y = y + layer.plain_bias
        return y

    def fused(self, layer, kernel, dtype: torch.dtype):
        """One quant_gemv per part into its columns, and where int8 activations apply in a
        decode batch (the decode stack's steps are decode batches; any dtype) quant_gemm_int8 from
        part_int8_rows() for the code widths it takes, as apply() and matmul(). Up to the rows the
        passes of the other parts take in one call (call_rows); any number where every part takes
        the int8 product.
        The stack calls the platform build's products through planes_product (not the
        dispatcher): any other kernel (the portable build) is not fused."""
        if self.kernel is not kernels.quant_linear():
            return None
        int8 = self.int8_mode != "off"
        int8_bits = self.int8_bits if int8 else frozenset()
        linear = kernel.FusedLinear(layer.out_features, layer.plain_bias)
        product = self.kernel.planes_product_address()
        for part in layer.quantized.parts:
            args = (*part.planes(), *_format_args(part))
            linear.add_quantized(*args, self.part_int8_rows(part) if int8 else 0,
                                 self.kernel.checked_planes(*args, part.k), product)
        passes = [self.call_rows(p, dtype) for p in layer.quantized.parts if p.fmt.bits not in int8_bits]
        return linear, min(passes, default=None)

    def fused_rows(self, weight: QuantizedWeight) -> tuple[torch.Tensor, int] | None:
        """An embedding table's lookup as the decode stack calls it: (its planes checked once, the
        address of the kernel's planes_rows), as embed() computes it; None where embed() would not
        take that one call (a table of several parts, another kernel than the platform's build)."""
        if self.kernel is not kernels.quant_linear() or len(weight.parts) != 1:
            return None
        part = weight.parts[0]
        return self.kernel.checked_planes(*part.planes(), *_format_args(part), part.k), self.kernel.planes_rows_address()

    def call_rows(self, part: PackedWeight, dtype: torch.dtype) -> int:
        """The most rows of `dtype` one call of the passes takes where the layers take passes too: in
        the panel layout every row up to part_gemv_max_rows (the weights stream once), in the row
        layout GEMV_ROWS. With oneDNN's crossovers whether or not a user has turned oneDNN off now
        (the smaller: the decode stack built with this limit stays with the layers either way)."""
        if not part.panels:
            return GEMV_ROWS
        return min(self.part_gemv_max_rows(part, dtype), self.part_gemv_max_rows(part, dtype, onednn=True),
                   self.panel_call_rows)

    def matmul(self, weight: QuantizedWeight, x: torch.Tensor) -> torch.Tensor:
        """x [m, k] @ weight^T -> [m, n] in x's dtype."""
        x = x.contiguous()
        return self._int8(weight, x) if self.int8_for(x) else self._plain(weight, x)

    def _int8(self, weight: QuantizedWeight, x: torch.Tensor) -> torch.Tensor:
        """The int8 product for parts of the code widths it takes (4 to 6 bits; 8 too with VNNI);
        others as without it."""
        out = torch.empty(x.shape[0], weight.n, dtype=x.dtype)
        for part, columns in _part_columns(weight, out):
            if 0 < self.part_int8_rows(part) <= x.shape[0]:
                self.kernel.gemm_int8(x, *part.planes(), *_format_args(part), columns)
            else:
                self._plain_part(part, x, columns)
        return out

    def _plain(self, weight: QuantizedWeight, x: torch.Tensor) -> torch.Tensor:
        """Without int8 activations, part by part into its columns."""
        out = torch.empty(x.shape[0], weight.n, dtype=x.dtype)
        for part, columns in _part_columns(weight, out):
            self._plain_part(part, x, columns)
        return out

    def _plain_part(self, part: PackedWeight, x: torch.Tensor, out: torch.Tensor) -> None:
        """Passes of the matrix-vector product up to part_gemv_max_rows; more rows: gemm_bf16 for
        bf16 (gemm_f32 for float32) against the panel layout where the kernel has it, else
        dequantized tiles."""
        if x.shape[0] <= self.part_gemv_max_rows(part, x.dtype):
            step = self.panel_call_rows if part.panels else GEMV_ROWS
            for first in range(0, x.shape[0], step):
                rows = slice(first, first + step)
                self.kernel.gemv(x[rows], *part.planes(), *_format_args(part), out[rows])
        elif self._takes_bf16_gemm(part, x.dtype):
            self.kernel.gemm_bf16(x, *part.planes(), *_format_args(part), out)
        elif self._takes_f32_gemm(part, x.dtype):
            self.kernel.gemm_f32(x, *part.planes(), *_format_args(part), out)
        else:
            rows = max(16, TILE_BYTES // (part.k * x.element_size()) // 16 * 16)   # whole panels a thread
            for first in range(0, part.n, rows):
                ids = torch.arange(first, min(first + rows, part.n))
                out[:, first:first + ids.numel()] = F.linear(x, self.dequantize(part, ids, x.dtype))

    def _takes_bf16_gemm(self, part: PackedWeight, dtype: torch.dtype, onednn: bool | None = None) -> bool:
        # brgemm is oneDNN's: off while a user turns oneDNN off (torch.backends.mkldnn.flags);
        # onednn: as if it were on (True) or off, rather than as it is now
        on = torch.backends.mkldnn.enabled if onednn is None else onednn
        return self.bf16_gemm and dtype == torch.bfloat16 and part.panels and on

    def _takes_f32_gemm(self, part: PackedWeight, dtype: torch.dtype, onednn: bool | None = None) -> bool:
        on = torch.backends.mkldnn.enabled if onednn is None else onednn
        return self.f32_gemm and dtype == torch.float32 and part.panels and on

    def gemv_max_rows(self, weight: QuantizedWeight, dtype: torch.dtype) -> int:
        """The most rows of `dtype` that every part takes in passes of the matrix-vector product."""
        return min(self.part_gemv_max_rows(p, dtype) for p in weight.parts)

    def part_gemv_max_rows(self, part: PackedWeight, dtype: torch.dtype, onednn: bool | None = None) -> int:
        """The most rows of `dtype` that take passes of the matrix-vector product rather than the
        matrix-matrix product (the measured crossovers above); onednn as in _takes_bf16_gemm."""
        if self._takes_f32_gemm(part, dtype, onednn):
            # the crossovers were measured on AVX2; the 8-row pass of AVX-512 builds keeps the rows
            # it took before gemm_f32 (the same as GEMV_MAX_ROWS) until measured there
            return GEMV_MAX_ROWS if self.wide_pass else F32_GEMM_GEMV_MAX_ROWS[part.fmt.bits]
        if dtype == torch.float32 or not self.wide_pass or not part.panels:
            return GEMV_MAX_ROWS
        if self._takes_bf16_gemm(part, dtype, onednn):
            return BF16_GEMM_GEMV_MAX_ROWS
        return WIDE_GEMV_MAX_ROWS.get(part.fmt.bits, GEMV_MAX_ROWS)

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


def _part_columns(weight: QuantizedWeight, out: torch.Tensor):
    """(part, the view of out's columns it computes) for each part of weight."""
    start = 0
    for part in weight.parts:
        yield part, out[:, start:start + part.n]
        start += part.n


def _format_args(part: PackedWeight) -> tuple[int, int, int]:
    return part.fmt.bits, part.fmt.group, part.fmt.zero
