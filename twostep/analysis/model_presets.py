"""Well-known models by name, as the fields of their public config.json that the analysis reads.

Each `config_json` is copied from the model's config.json on the Hugging Face hub (the repo named),
trimmed to what parameter and KV counting need. `published_params` is the parameter count the model
card states, kept so tests can hold our counting against it; for a mixture of experts it is the
total, and `published_active` the card's "activated" count (both with the embedding and the head).
"""
from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class ModelPreset:
    key: str
    name: str
    repo: str
    published_params: float
    config_json: str
    published_active: float | None = None     # a mixture of experts': parameters a token runs through
    # how far the count may fall from the published one: 1%, as most cards give 3 digits; more where
    # the card gives only the name's round figure and it includes a vision tower not counted here
    published_tolerance: float = 0.01

    def hf_config(self) -> dict:
        return json.loads(self.config_json)


MODEL_PRESETS = (
    ModelPreset("qwen2.5-7b", "Qwen2.5-7B", "Qwen/Qwen2.5-7B", 7.61e9, """{
        "architectures": ["Qwen2ForCausalLM"], "hidden_size": 3584, "intermediate_size": 18944,
        "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
        "vocab_size": 152064, "max_position_embeddings": 131072, "tie_word_embeddings": false,
        "torch_dtype": "bfloat16"}"""),
    ModelPreset("qwen2.5-72b", "Qwen2.5-72B", "Qwen/Qwen2.5-72B", 72.7e9, """{
        "architectures": ["Qwen2ForCausalLM"], "hidden_size": 8192, "intermediate_size": 29568,
        "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
        "vocab_size": 152064, "max_position_embeddings": 131072, "tie_word_embeddings": false,
        "torch_dtype": "bfloat16"}"""),
    ModelPreset("qwen2.5-0.5b", "Qwen2.5-0.5B", "Qwen/Qwen2.5-0.5B", 0.49e9, """{
        "architectures": ["Qwen2ForCausalLM"], "hidden_size": 896, "intermediate_size": 4864,
        "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
        "vocab_size": 151936, "max_position_embeddings": 32768, "tie_word_embeddings": true,
        "torch_dtype": "bfloat16"}"""),
    ModelPreset("llama-3.1-8b", "Llama-3.1-8B", "meta-llama/Llama-3.1-8B", 8.03e9, """{
        "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "vocab_size": 128256, "max_position_embeddings": 131072, "tie_word_embeddings": false,
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "torch_dtype": "bfloat16"}"""),
    ModelPreset("llama-3-70b", "Llama-3-70B", "meta-llama/Meta-Llama-3-70B", 70.6e9, """{
        "architectures": ["LlamaForCausalLM"], "hidden_size": 8192, "intermediate_size": 28672,
        "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
        "vocab_size": 128256, "max_position_embeddings": 8192, "tie_word_embeddings": false,
        "torch_dtype": "bfloat16"}"""),
    ModelPreset("smollm2-135m", "SmolLM2-135M", "HuggingFaceTB/SmolLM2-135M", 135e6, """{
        "architectures": ["LlamaForCausalLM"], "hidden_size": 576, "intermediate_size": 1536,
        "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
        "vocab_size": 49152, "max_position_embeddings": 8192, "tie_word_embeddings": true,
        "torch_dtype": "bfloat16"}"""),
    # five of every six layers attend within 512 tokens
    ModelPreset("gemma-3-1b", "Gemma-3-1B", "google/gemma-3-1b-it", 1.0e9, """{
        "architectures": ["Gemma3ForCausalLM"], "hidden_size": 1152, "intermediate_size": 6912,
        "num_hidden_layers": 26, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
        "vocab_size": 262144, "max_position_embeddings": 32768, "query_pre_attn_scalar": 256,
        "sliding_window": 512, "sliding_window_pattern": 6, "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0, "hidden_activation": "gelu_pytorch_tanh",
        "torch_dtype": "bfloat16"}"""),
    # a mixture of experts: 128 experts of 768 in every layer, 8 per token; "30.5B in total and 3.3B
    # activated" (the card)
    ModelPreset("qwen3-30b-a3b", "Qwen3-30B-A3B", "Qwen/Qwen3-30B-A3B", 30.5e9, """{
        "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 2048, "intermediate_size": 6144,
        "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": true,
        "vocab_size": 151936, "max_position_embeddings": 40960, "rope_theta": 1000000.0,
        "tie_word_embeddings": false, "torch_dtype": "bfloat16"}""", published_active=3.3e9),
    # dense, every layer attends: the hybrids' counterpart at their size (Qwen3.5-0.8B's hidden 1024)
    ModelPreset("qwen3-0.6b", "Qwen3-0.6B", "Qwen/Qwen3-0.6B", 0.6e9, """{
        "architectures": ["Qwen3ForCausalLM"], "hidden_size": 1024, "intermediate_size": 3072,
        "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
        "vocab_size": 151936, "max_position_embeddings": 40960, "rope_theta": 1000000.0,
        "tie_word_embeddings": true, "torch_dtype": "bfloat16"}"""),
    # Hybrids: three of every four layers Gated DeltaNet linear attention (a state per sequence, no
    # K/V), every fourth gated full attention. Qwen3.5 checkpoints are multimodal: the shape is the
    # text_config of the published config.json (its vision tower is not counted: the cards' sizes,
    # which include it, are only the name's round figure).
    ModelPreset("qwen3.5-0.8b", "Qwen3.5-0.8B", "Qwen/Qwen3.5-0.8B", 0.8e9, """{
        "architectures": ["Qwen3_5ForConditionalGeneration"], "tie_word_embeddings": true,
        "text_config": {
            "hidden_size": 1024, "intermediate_size": 3584, "num_hidden_layers": 24,
            "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 256, "attn_output_gate": true,
            "full_attention_interval": 4, "linear_num_key_heads": 16, "linear_num_value_heads": 16,
            "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
            "vocab_size": 248320, "max_position_embeddings": 262144, "tie_word_embeddings": true,
            "rope_parameters": {"rope_theta": 10000000, "partial_rotary_factor": 0.25},
            "dtype": "bfloat16"}}""", published_tolerance=0.1),      # 0.752B counted, "0.8B" named
    ModelPreset("qwen3.5-27b", "Qwen3.5-27B", "Qwen/Qwen3.5-27B", 27e9, """{
        "architectures": ["Qwen3_5ForConditionalGeneration"], "tie_word_embeddings": false,
        "text_config": {
            "hidden_size": 5120, "intermediate_size": 17408, "num_hidden_layers": 64,
            "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256, "attn_output_gate": true,
            "full_attention_interval": 4, "linear_num_key_heads": 16, "linear_num_value_heads": 48,
            "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
            "vocab_size": 248320, "max_position_embeddings": 262144, "tie_word_embeddings": false,
            "rope_parameters": {"rope_theta": 10000000, "partial_rotary_factor": 0.25},
            "dtype": "bfloat16"}}"""),
    # a hybrid mixture of experts: 256 experts of 512 in every layer, 8 per token, beside a gated
    # shared expert of 512; "35B in total and 3B activated" (the card)
    ModelPreset("qwen3.5-35b-a3b", "Qwen3.5-35B-A3B", "Qwen/Qwen3.5-35B-A3B", 35e9, """{
        "architectures": ["Qwen3_5MoeForConditionalGeneration"], "tie_word_embeddings": false,
        "text_config": {
            "hidden_size": 2048, "num_hidden_layers": 40, "num_attention_heads": 16,
            "num_key_value_heads": 2, "head_dim": 256, "attn_output_gate": true, "full_attention_interval": 4,
            "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
            "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "num_experts": 256,
            "num_experts_per_tok": 8, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
            "vocab_size": 248320, "max_position_embeddings": 262144, "tie_word_embeddings": false,
            "rope_parameters": {"rope_theta": 10000000, "partial_rotary_factor": 0.25},
            "dtype": "bfloat16"}}""", published_active=3e9),
    # counted: 34.66B and 3.45B active (1.02B of which the embedding and the head; "A3B" is round)
    # 512 experts of 512 in every layer, 10 per token, beside a gated shared expert of 512; "80B in
    # total and 3B activated" (the card)
    ModelPreset("qwen3-next-80b-a3b", "Qwen3-Next-80B-A3B", "Qwen/Qwen3-Next-80B-A3B-Instruct", 80e9, """{
        "architectures": ["Qwen3NextForCausalLM"], "hidden_size": 2048, "intermediate_size": 5120,
        "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
        "full_attention_interval": 4, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
        "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
        "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "norm_topk_prob": true, "vocab_size": 151936, "max_position_embeddings": 262144,
        "rope_theta": 10000000, "partial_rotary_factor": 0.25, "tie_word_embeddings": false,
        "torch_dtype": "bfloat16"}""", published_active=3e9),
    # counted: 79.67B (without the multi-token-prediction layer) and 3.87B active (0.62B of which the
    # embedding and the head)
)


def find_model_preset(name: str) -> ModelPreset | None:
    """By key ("qwen2.5-7b") or hub repo id ("Qwen/Qwen2.5-7B"), in any case."""
    key = name.lower()
    for preset in MODEL_PRESETS:
        if key in (preset.key, preset.repo.lower(), preset.name.lower()):
            return preset
    return None
