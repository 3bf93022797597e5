"""The mixture-of-experts block (Qwen3-MoE, Mixtral, gpt-oss) in place of a layer's MLP: a router
scores the experts for each token and keeps its top k with their weights; each chosen expert's
gated MLP runs on the tokens that chose it, and each token's row is the weighted sum of its experts'
outputs (vLLM's FusedMoE, llama.cpp's mul_mat_id).

Every expert's matrices are stacked into one weight per projection (ExpertLinear: gate_proj and
up_proj [E * I, H], down_proj [E * H, I], expert e's rows at e * n): a quantized file's expert
tensors load, pack and sit in memory as any other weight, and a step reads the chosen experts'
rows only. How the experts run is their method's: a platform's kernel (the CPU's runs a step's
experts in one call, platforms/cpu/experts.py) or, without one, the loop below in torch.

Under tensor parallelism each rank holds every expert's share of the intermediate features (the
rows of gate/up, the columns of down); the router runs whole on every rank and the sum after
down meets the other ranks, as a dense MLP's does.
"""
from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from twostep.distributed.parallel import TensorParallel
from twostep.layers.linear import Linear
from twostep.layers.mlp import GatedMLP


class ExpertLinear(Linear):
    """num_experts matrices [rows, in] stacked into one [num_experts * rows, in] (and a bias each)."""

    def __init__(self, num_experts: int, in_features: int, rows: int, bias: bool, active: int) -> None:
        super().__init__(in_features, num_experts * rows, bias)
        self.num_experts, self.rows = num_experts, rows
        self.active = active        # the experts one token reads

    def expert(self, e: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Expert e's float weight [rows, in] and bias (views)."""
        cut = slice(e * self.rows, (e + 1) * self.rows)
        return self.weight[cut], None if self.bias is None else self.bias[cut]


def route(logits: torch.Tensor, top_k: int, kind: str, renormalise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, k] float32, expert ids [T, k] int64), as transformers
    picks them (torch.topk, so a tie goes the same way)."""
    if kind == "topk_softmax":
        top, ids = torch.topk(logits.float(), top_k, dim=-1)
        return torch.softmax(top, dim=-1), ids
    weights, ids = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float32), top_k, dim=-1)
    if renormalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def gated(gate: torch.Tensor, up: torch.Tensor, act: str, alpha: float, limit: float | None) -> torch.Tensor:
    """The experts' activation of [rows, I] gate and up projections: SiLU (Qwen3-MoE, Mixtral) or
    gpt-oss's clamped SwiGLU, (up + 1) * gate * sigmoid(alpha * gate) after clamping both."""
    if act == "swiglu_oai":
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))
    return F.silu(gate) * up


class ExpertsMethod(Protocol):
    name: str

    def apply(self, experts: "Experts", x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """sum over j of weights[t, j] * expert ids[t, j]'s MLP of x[t], for each row t of x [T, H]."""
        ...


class TorchExperts:
    """Each chosen expert over its rows in torch (float weights), as transformers computes it."""

    name = "torch"

    def apply(self, experts: "Experts", x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(x.shape, dtype=torch.float32)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)        # the (row, slot) pairs, expert by expert
        counts = torch.bincount(flat, minlength=experts.num_experts).tolist()
        start = 0
        for e, count in enumerate(counts):
            if count == 0:
                continue
            pairs = order[start:start + count]
            start += count
            rows = pairs // ids.shape[1]
            h = x[rows]
            gate, up = F.linear(h, *experts.gate_proj.expert(e)), F.linear(h, *experts.up_proj.expert(e))
            y = F.linear(gated(gate, up, experts.act, experts.alpha, experts.limit), *experts.down_proj.expert(e))
            out.index_add_(0, rows, y.float() * weights.reshape(-1)[pairs, None])
        return out.to(x.dtype)


class Experts(nn.Module):
    """Every expert's gated MLP, stacked (ExpertLinear), and the method that runs the chosen ones."""

    def __init__(self, cfg) -> None:
        super().__init__()
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.num_experts = e
        self.act, self.alpha, self.limit = cfg.hidden_act, cfg.swiglu_alpha, cfg.swiglu_limit
        k = cfg.num_experts_per_tok
        self.gate_proj = ExpertLinear(e, h, i, cfg.expert_bias, k)
        self.up_proj = ExpertLinear(e, h, i, cfg.expert_bias, k)
        self.down_proj = ExpertLinear(e, i, h, cfg.expert_bias, k)
        self.method: ExpertsMethod = TorchExperts()

    def set_method(self, method: ExpertsMethod) -> None:
        """method.bind(self) first, where it prepares what its calls take."""
        if hasattr(method, "bind"):
            method.bind(self)
        self.method = method

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x, weights, ids)

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, act={self.act}, method={self.method.name}"


class SparseMoE(nn.Module):
    """router (`gate`, as HF names it) -> top-k experts -> their weighted sum."""

    def __init__(self, cfg, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.top_k, self.router, self.renormalise = cfg.num_experts_per_tok, cfg.router, cfg.norm_topk_prob
        self.gate = Linear(cfg.hidden_size, cfg.num_experts, bias=cfg.router_bias)
        self.experts = Experts(cfg)
        # Qwen2-MoE: an expert every token takes, its output times sigmoid(shared_expert_gate(x))
        shared = cfg.shared_expert_intermediate_size
        self.shared_expert = GatedMLP(cfg.hidden_size, shared, cfg.hidden_act, tp) if shared else None
        self.shared_expert_gate = Linear(cfg.hidden_size, 1, bias=False) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.router, self.renormalise)
        out = self.tp.all_reduce(self.experts(x, weights, ids))
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

    def emit(self, p, dst: int, src: int) -> None:
        """forward as one instruction of the decode program (models/fused_decode.py)."""
        p.moe(dst, src, self)

    def extra_repr(self) -> str:
        return f"top_k={self.top_k}, router={self.router}, renormalise={self.renormalise}"
