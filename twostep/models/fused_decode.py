"""A decode step's decoder layers as one C++ call (twostep/kernels/csrc/decode_step.cpp), where the
platform has every kernel it needs: the role CUDA graphs play for vLLM's decode, on a CPU.

Why: at batch 1 a step is ~10 kernel calls a layer, and the Python around each (module calls,
views, wrappers, the attention plan's indirection) cost as much as a third of a small model's step.
The stack is a program the model's own blocks write at load: each block's emit() sits beside its
forward() and hands the program the same ops, in the same order, with the same weights (norms,
linears, the activation, the attention with its per-layer options, a mixture of experts' router
and experts kernel, residual adds and scales), so
no family has a layer sequence written twice and a new block is written once, in Python. The
program runs the same registered ops with the same arguments, so its results are bit-identical to
the layers' (tests/models/test_fused_decode.py checks it for every family, float32, bf16 and
quantized weights). It starts from the step's token ids and
positions (the embedding's and rotary tables' rows) and ends with the final norm and, where the
step wants every row's logits and the lm_head fuses, the float32 logits: the Python that ran those
ends would run with the caches just evicted by the step's weight stream.

It takes a decode batch (platforms/step_kind.py: every row a generated position, not a prompt's
last token) with one row per sequence (no drafts to verify), at most `max_rows` rows (the fewest any
linear's matrix-vector path takes; any number where every quantized part takes the int8 product),
through the attention backend it was built for (the paged decode kernel, an unquantized cache) and
on one rank. Any other step runs the layers one by one: one model, one forward, two ways of
driving it.
"""
from __future__ import annotations

import logging

import torch

from twostep.attention.backend import HybridBackend
from twostep.attention.linear_state import StateMetadata
from twostep.attention.paged_decode import PagedDecode
from twostep.platforms import Platform
from twostep.platforms.step_kind import in_decode_batch

# The per-layer ops the C++ stack calls through the dispatcher: the platform must run each of them
# in the layers too, or the two ways would compute different things.
FUSED_OPS = ("rms_norm", "add_rms_norm", "silu_and_mul", "rotary", "rotary_")

ANY_ROWS = 1 << 30          # max_rows where no linear limits the rows
_NONE = torch.empty(0)      # another kind of layer's cache, in the per-layer lists the stack takes

logger = logging.getLogger(__name__)


class FusedDecode:
    def __init__(self, stack, max_rows: int, backend: HybridBackend, head_rows: int = 0) -> None:
        self.stack, self.max_rows, self.backend = stack, max_rows, backend
        self.head_rows = head_rows      # the most rows whose logits the stack computes (its lm_head's limit)
        self._lists: tuple | None = None

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list, metas: list, backend,
                 logits: bool = False) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """(the final norm's output, and where `logits` asks for every row's and the stack's lm_head
        takes the rows, their float32 logits, else None) for a step it takes; None for one it does not."""
        # the backend it was built for builds HybridMetadata
        # a decode batch has only decode rows in the metadata; the stack takes one per sequence
        # (a sequence verifying drafts has more: the layers run those steps)
        rows = input_ids.shape[0]
        if not in_decode_batch() or backend is not self.backend or rows > self.max_rows:
            return None
        plan = metas[0].decode
        if rows != plan.seq_lens.shape[0]:
            return None
        states = metas[-1] if isinstance(metas[-1], StateMetadata) else None
        if states is not None:
            if len(states.decodes) != rows or states.saves:
                return None
            metas = metas[:-1]
        values, conv, recurrent = self._caches(kv_caches)
        return self.stack.forward(input_ids, positions, values,
                                  [m.common.slot_mapping for m in metas], plan.rows.index, plan.query_lens,
                                  [m.decode.tables for m in metas], plan.seq_lens, conv, recurrent,
                                  None if states is None else states.decode_slots, logits and rows <= self.head_rows)

    def _caches(self, layer_caches: list) -> tuple[list, list, list]:
        """Each layer's K/V values, conv and recurrent states (another kind's: an empty tensor), the
        same lists every step."""
        if self._lists is None or self._lists[0] is not layer_caches:
            self._lists = (layer_caches, *([getattr(c, name, _NONE) for c in layer_caches]
                                           for name in ("values", "conv", "recurrent")))
        return self._lists[1:]


def fuse_decode(model, platform: Platform, dtype: torch.dtype, backend: HybridBackend) -> FusedDecode | None:
    """The model's decode stack, or None where a kernel it needs is missing here (then every step
    runs the layers one by one). An 8-bit cache has neither the paged kernel nor the one-call write."""
    kernel = platform.decode_step_kernel()
    why_not = _why_not_fused(model, platform, dtype, backend, kernel)
    if why_not is not None:
        logger.info("decode steps run layer by layer, not as one call: %s", why_not)
        return None
    try:
        return _build(model, kernel, backend, dtype)
    except RuntimeError as e:       # an op it calls is not registered (its kernel did not load)
        logger.warning("decode stack unavailable (%s); decode steps run layer by layer", str(e).splitlines()[0])
        return None


def _why_not_fused(model, platform: Platform, dtype: torch.dtype, backend: HybridBackend, kernel) -> str | None:
    """Why this model's decode steps cannot run as one call here, or None where they can."""
    if kernel is None:
        return "its kernel is not built here"
    if model.tp.world_size > 1:
        return "tensor parallelism"
    if not isinstance(backend.decode, PagedDecode):
        return "the attention backend is not the paged decode kernel"
    if backend.write_values is None:
        return "the KV cache has no one-call write (an 8-bit cache)"
    if any(platform.custom_op(n, dtype) is None for n in FUSED_OPS):
        return "an elementwise kernel is not built here"
    return None


class NotFused(Exception):
    """A block's weights have no form the program can call here."""


class ProgramBuilder:
    """What the model's blocks emit (their emit(), beside their forward()), handed to the C++
    program with each module's weights in the form it calls."""

    def __init__(self, program, kernel, dtype: torch.dtype, rope_kinds: list[str]) -> None:
        self.program, self.kernel, self.dtype = program, kernel, dtype
        self.rope_kinds = rope_kinds
        self.limits: list[int] = []     # the most rows each linear's fused form takes

    def norm(self, dst: int, src: int, norm) -> None:
        self.program.norm(dst, src, norm.weight.detach(), norm.eps)

    def add_norm(self, dst: int, src: int, norm) -> None:
        self.program.add_norm(dst, src, norm.weight.detach(), norm.eps)

    def set_residual(self, src: int) -> None:
        self.program.set_residual(src)

    def add_residual(self, src: int) -> None:
        self.program.add_residual(src)

    def scale(self, dst: int, src: int, factor: float) -> None:
        self.program.scale(dst, src, factor)

    def scale_by(self, dst: int, src: int, factor: torch.Tensor) -> None:
        self.program.scale_by(dst, src, factor)

    def act(self, dst: int, src: int, kind: str) -> None:
        self.program.act(dst, src, ACTIVATIONS.index(kind))

    def linear(self, dst: int, src: int, linear) -> None:
        self.program.linear(dst, src, self.fused(linear))

    def fused(self, linear):
        fused = linear.method.fused(linear, self.kernel, self.dtype)
        if fused is None:
            raise NotFused(f"{linear.method.name} weights have no matrix-vector kernel for {self.dtype} here")
        if fused[1] is not None:
            self.limits.append(fused[1])
        return fused[0]

    def moe(self, dst: int, src: int, moe) -> None:
        experts = moe.experts
        fused = getattr(experts.method, "fused", None)
        args = None if fused is None else fused(experts, self.kernel)
        if args is None:
            raise NotFused(f"{experts.method.name} experts have no kernel the program calls")
        self.program.moe(dst, src, self.fused(moe.gate), moe.top_k, moe.router == "topk_softmax", moe.renormalise,
                         *args)
        shared = moe.shared_expert
        if shared is not None:
            self.program.moe_shared(self.fused(shared.gate_up_proj), self.fused(shared.down_proj),
                                    self.fused(moe.shared_expert_gate), ACTIVATIONS.index(shared.act_name))

    def attention(self, dst: int, src: int, attn) -> None:
        o = attn.options
        q_norm, k_norm = (None, None) if attn.q_norm is None else (attn.q_norm.weight.detach(),
                                                                   attn.k_norm.weight.detach())
        eps = attn.q_norm.eps if attn.q_norm is not None else 0.0
        self.program.attention(
            dst, src, attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.rotary_dim,
            QK_NORMS.index(attn.qk_norm), q_norm, k_norm, eps,
            -1 if attn.rope_kind is None else self.rope_kinds.index(attn.rope_kind),
            o.scale, o.window or 0, o.softcap or 0.0,
            o.sinks, attn.layer, attn.kv_group, attn.gate_size > 0,
            self.fused(attn.qkv_proj), self.fused(attn.o_proj))

    def linear_attention(self, dst: int, src: int, layer) -> None:
        if layer.decode_kernel is None:
            raise NotFused("the linear-attention layers' decode kernel is not built here")
        self.program.linear_attention(
            dst, src, self.fused(layer.in_proj_qkv), self.fused(layer.in_proj_z), self.fused(layer.in_proj_b),
            self.fused(layer.in_proj_a), self.fused(layer.out_proj), layer.conv1d.weight.detach().squeeze(1),
            layer.A_log.detach(), layer.dt_bias.detach(), layer.norm.weight.detach(), layer.norm.eps,
            layer.num_k_heads, layer.head_k_dim, layer.head_v_dim, layer.layer)


ACTIVATIONS = ["silu", "gelu_tanh"]         # the program's activation numbers
QK_NORMS = [None, "head", "full"]


def _build(model, kernel, backend: HybridBackend, dtype: torch.dtype) -> FusedDecode | None:
    cfg = model.config
    program = kernel.DecodeProgram()
    # the embedding's and each rotary table's rows from the step's ids and positions
    embedding = model.model.embed_tokens
    x_dtype = embedding.dtype or embedding.weight.dtype
    kinds = list(model.rotary)
    tables = [model.rotary[k].tables(x_dtype) for k in kinds]
    cos, sin = [c for c, _ in tables], [s for _, s in tables]
    if embedding.quantized is None:
        program.set_inputs(cos, sin, x_dtype, embedding.weight.detach(), None, 0, cfg.hidden_size)
    else:
        fused_rows = getattr(embedding.method, "fused_rows", None)
        rows = None if fused_rows is None else fused_rows(embedding.quantized)
        if rows is None:
            return None
        program.set_inputs(cos, sin, x_dtype, None, *rows, cfg.hidden_size)
    builder = ProgramBuilder(program, kernel, dtype, kinds)
    try:
        model.emit(builder, x_dtype)
    except NotFused as e:
        logger.info("decode steps run layer by layer, not as one call: %s", e)
        return None
    # the lm_head too where its method fuses (else the model computes the logits after the call)
    head = model.lm_head.method.fused(model.lm_head, kernel, dtype)
    program.set_head(None if head is None else head[0])
    head_rows = 0 if head is None else ANY_ROWS if head[1] is None else head[1]
    return FusedDecode(program, min(builder.limits, default=ANY_ROWS), backend, head_rows)
