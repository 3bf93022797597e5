"""SmolLM3: Llama's layers, with every fourth layer (no_rope_layers) attending without rotary
embeddings (NoPE)."""
from __future__ import annotations

from twostep.models.causal_lm import CausalLM
from twostep.models.config import ModelConfig, base_config, sliding_window, window_layers
from twostep.models.family import Family


class SmolLM3ForCausalLM(CausalLM):
    pass


def smollm3_config(cfg: dict, arch: str) -> ModelConfig:
    layers = cfg["num_hidden_layers"]
    uses_rope = cfg.get("no_rope_layers")
    if uses_rope is None:               # HF's default: NoPE every no_rope_layer_interval-th layer
        interval = cfg.get("no_rope_layer_interval", 4)
        uses_rope = [int((i + 1) % interval != 0) for i in range(layers)]
    window = sliding_window(cfg)
    bias = bool(cfg.get("attention_bias", False))
    return base_config(cfg, arch, qkv_bias=bias, o_bias=bias,
                       no_rope_layers=tuple(i for i, rope in enumerate(uses_rope) if not rope),
                       sliding_window=window, layer_types=window_layers(cfg, layers) if window else None)


SMOLLM3 = Family("smollm3", SmolLM3ForCausalLM, smollm3_config, ("SmolLM3ForCausalLM",), ("smollm3",))
