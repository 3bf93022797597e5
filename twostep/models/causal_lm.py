"""The causal LM every family file builds: embedding (times the family's scale), its decoder
layers, the final norm, and the lm_head (logits times the family's scale, soft-capped where it
caps them). A family file subclasses it and names its layer (layers/decoder_layer.py).

Module names mirror HF's, except that q/k/v and gate/up are fused into one matmul each
(qkv_proj, gate_up_proj; models/weights.py concatenates the checkpoint's tensors): fewer,
larger matmuls per layer. forward() takes a flat batch of tokens (no padding) plus the attention
backend and the metadata it built for this step, and knows nothing of requests or scheduling.
Platforms and weight formats plug in from outside (layers/dispatch.py): the model is the math.
Under tensor parallelism (distributed/parallel.py) the config is a rank's share (its heads and
intermediate features) and three places meet the other ranks: the sum after o_proj and after
down_proj, the vocab-parallel lookup, and the logits gathered over the vocabulary.
"""
from __future__ import annotations

from typing import Callable, ClassVar

import torch
from torch import nn

from twostep.attention.backend import AttentionBackend
from twostep.distributed.parallel import TensorParallel
from twostep.layers.decoder_layer import X, DecoderLayer, PreNormLayer
from twostep.layers.embedding import Embedding
from twostep.layers.linear import Linear
from twostep.layers.norm import RMSNorm
from twostep.layers.rotary import RotaryEmbedding
from twostep.models.config import ModelConfig


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel, layer: type[DecoderLayer]) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size // tp.world_size, cfg.hidden_size)
        self.layers = nn.ModuleList(layer(cfg, i, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """embed -> N x layer -> norm; lm_head only where logits are needed."""

    layer: ClassVar[type[DecoderLayer]] = PreNormLayer

    def __init__(self, cfg: ModelConfig, tp: TensorParallel = TensorParallel()) -> None:
        super().__init__()
        self.config, self.tp = cfg, tp
        self.model = DecoderModel(cfg, tp, self.layer)
        # None for a pooling checkpoint without one (models/loader.py): it pools, it cannot generate
        self.lm_head: Linear | None = Linear(cfg.hidden_size, cfg.vocab_size // tp.world_size, bias=False)
        self.score: Linear | None = None    # a classifier's head on the pooled hidden state, set at load
        self.rotary = nn.ModuleDict()       # kind -> RotaryEmbedding (init_rotary), each a CustomOp
        # fn(x, rope, kv_caches, metas, backend) -> (x, residual) running every layer of the steps it
        # takes in one platform call, None for the others (models/fused_decode.py); bound at load
        self.fused_decode: Callable | None = None

    def init_rotary(self, max_positions: int, device: torch.device) -> None:
        """The rotary tables each kind of layer reads (Gemma 3's sliding layers: their own base)."""
        c = self.config
        dim = c.rotary_dim or c.head_dim
        kinds = {c.rope_kind(i) for i in range(c.num_layers)} - {None}
        for kind in sorted(kinds):
            local = kind == "local"
            self.rotary[kind] = RotaryEmbedding(dim, c.rope_local_theta if local else c.rope_theta,
                                                None if local else c.rope_scaling, max_positions, device,
                                                None if local else c.rope_freq_factors)

    def loaded(self) -> None:
        """Once the checkpoint's tensors are in: the tied head, and what blocks derive from their
        weights (attention sinks into the options)."""
        self.tie_weights()
        for m in self.modules():
            if m is not self and hasattr(m, "loaded"):
                m.loaded()

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings and self.lm_head is not None:
            embedding = self.model.embed_tokens
            self.lm_head.weight, self.lm_head.quantized = embedding.weight, embedding.quantized

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list, metas: list,
                backend: AttentionBackend) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, hidden]. metas: the backend's metadata
        of each KV-cache group; a layer reads its cache's group's."""
        return self.hidden_and_logits(input_ids, positions, kv_caches, metas, backend)[0]

    def hidden_and_logits(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list, metas: list,
                          backend: AttentionBackend, every_row: bool = False,
                          ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """forward's hidden states, and where every_row asks for all their logits and the decode
        stack takes the step with its lm_head, compute_logits of them from the stack's call (else None:
        the caller computes the logits of the rows it wants)."""
        if self.fused_decode is not None:
            fused = self.fused_decode(input_ids, positions, kv_caches, metas, backend, every_row)
            if fused is not None:
                hidden, logits = fused
                return hidden, None if logits is None else self.scale_logits(logits)
        x = self.embed(input_ids)
        ropes = {kind: rotary.lookup(positions, x.dtype) for kind, rotary in self.rotary.items()}
        residual = None
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            x, residual = layer(x, residual, ropes, kv_cache, metas[kv_cache.group], backend)
        return self.model.norm(x, residual), None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.tp.embed(self.model.embed_tokens, input_ids, self.config.vocab_size)
        return x if self.config.embed_scale is None else x * self.embed_scale(x.dtype)

    def embed_scale(self, dtype: torch.dtype) -> torch.Tensor:
        # HF's Gemma rounds its scale to the weights' dtype before the multiply
        return torch.tensor(self.config.embed_scale, dtype=torch.float32).to(dtype)

    def emit(self, p, dtype: torch.dtype) -> None:
        """The layers' forward as the decode program's instructions (models/fused_decode.py): the
        program starts from the embeddings in X and ends with the final norm's output in X."""
        if self.config.embed_scale is not None:
            p.scale_by(X, X, self.embed_scale(dtype))
        for i, layer in enumerate(self.model.layers):
            layer.emit(p, i == 0)
        p.add_norm(X, X, self.model.norm)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.tp.gather_last_dim(self.lm_head(hidden).float())
        return self.scale_logits(logits)

    def scale_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The family's transform of the head's float32 output (Granite's scale, Gemma 2's soft-cap)."""
        c = self.config
        if c.logit_scale is not None:
            logits = logits * c.logit_scale
        if c.final_softcap is not None:
            logits = torch.tanh(logits / c.final_softcap) * c.final_softcap
        return logits
