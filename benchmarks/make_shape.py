"""A random-initialised model with a real model's shape: an HF folder and a BF16 GGUF.

    .venv/bin/python benchmarks/make_shape.py [--shape qwen2.5-0.5b] [--out /tmp/twostep-qwen-shape]
    .venv/bin/python benchmarks/make_shape.py --shape gemma-3-1b       # /tmp/twostep-gemma3-shape
    .venv/bin/python benchmarks/make_shape.py --shape qwen3-30b-a3b-mini   # /tmp/twostep-qwen3moe-shape
    .venv/bin/python benchmarks/make_shape.py --shape qwen3.5-0.8b     # /tmp/twostep-qwen35-shape (hybrid)
    .venv/bin/python benchmarks/make_shape.py --shape qwen3-0.6b       # /tmp/twostep-qwen3-shape

Shapes: Qwen2.5-0.5B (the default); Gemma 3 1B (26 layers, 22 of them attending within 512
tokens, one KV head of 256, a 262,144-token vocabulary); and Qwen3-30B-A3B scaled down, a
mixture of experts (Qwen3MoeForCausalLM) keeping its 128 experts with 8 per token (weights
renormalised over the 8), heads of 128 with 8 query heads per KV head, q/k norms, an untied
lm_head, the 151,936-row vocabulary and rope theta 1e6, but hidden size 1,024 (from 2,048),
12 layers (from 48), 16 query / 2 KV heads (from 32 / 4) and experts of 256 (from 768):
1.58B parameters in all, 0.29B per token (attention, router, 8 experts, norms and lm_head;
the lm_head alone is 0.16B). Hidden and expert sizes are multiples of 256, so every matrix's
rows fit the K-quants' 256-value blocks. The script prints each shape's two counts.

Writes, seeded and only what is not there yet:
  OUT/config.json, model.safetensors (bf16), tokenizer.json ...   for twostep and HF transformers
  OUT/model-bf16.gguf                                             for llama.cpp
No download: the weights are random (performance does not depend on their values) and the
tokenizer is a synthetic byte-level BPE with Qwen2's pre-tokenizer and Qwen2's vocabulary size
(151,643 tokens plus its 3 special tokens; the embedding has 151,936 rows, like Qwen's; Gemma's:
262,141 plus 3, 262,144 rows).
The GGUF comes from llama.cpp's own convert_hf_to_gguf.py (the one in the llama-cpp-python
sdist, --llama-cpp-src). That converter identifies a BPE tokenizer by hashing how it tokenizes
a probe string; a synthetic vocabulary cannot match Qwen2's hash, so the converter runs with
its pre-tokenizer detection answering "qwen2", which is what this tokenizer's pre-tokenizer is,
and (Gemma, whose converter expects a sentencepiece model) its vocabulary written the GPT-2 way.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

GGUF_NAME = "model-bf16.gguf"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]   # the last ids, as in Qwen2
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# Run the converter with its pre-tokenizer detection answering "qwen2" (see the docstring).
_CONVERT = """
import runpy, sys
script = sys.argv[1]
src = script.rsplit("/", 1)[0]
sys.path[:0] = [src, src + "/gguf-py"]
import conversion.base
conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
model_class = conversion.get_model_class
def gpt2_vocabulary(name, mmproj=False):
    cls = model_class(name, mmproj)
    cls.set_vocab = conversion.base.TextModel._set_vocab_gpt2
    return cls
conversion.get_model_class = gpt2_vocabulary
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
"""


def qwen_shape_config():
    from transformers import Qwen2Config

    return Qwen2Config(
        hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
        intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True,
        rope_theta=1_000_000.0, max_position_embeddings=32768, rms_norm_eps=1e-6,
        bos_token_id=151643, eos_token_id=151643, dtype="bfloat16")


def gemma3_shape_config():
    from transformers import Gemma3TextConfig

    special = 262144 - len(SPECIAL_TOKENS)
    return Gemma3TextConfig(
        hidden_size=1152, num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
        intermediate_size=6912, vocab_size=262144, tie_word_embeddings=True, query_pre_attn_scalar=256,
        sliding_window=512, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
        max_position_embeddings=32768, rms_norm_eps=1e-6, bos_token_id=special, eos_token_id=special,
        pad_token_id=special, dtype="bfloat16")


def qwen3_moe_shape_config():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        hidden_size=1024, num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=2, head_dim=128,
        moe_intermediate_size=256, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], intermediate_size=3072,   # 3x hidden, as 6,144 is; unused
        vocab_size=151936, tie_word_embeddings=False, rope_theta=1_000_000.0,
        max_position_embeddings=40960, rms_norm_eps=1e-6, bos_token_id=151643, eos_token_id=151643,
        dtype="bfloat16")


def qwen3_5_shape_config():
    """Qwen3.5-0.8B's text model, per its published config.json: 24 layers, three of four Gated
    DeltaNet (16 key and 16 value heads of 128), every fourth gated full attention (8 query / 2
    KV heads of 256, RoPE on a quarter of the head), a tied 248,320-row vocabulary."""
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        hidden_size=1024, num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2, head_dim=256,
        intermediate_size=3584, linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, vocab_size=248320, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
        max_position_embeddings=32768, rms_norm_eps=1e-6, bos_token_id=248044, eos_token_id=248044,
        dtype="bfloat16")


def qwen3_shape_config():
    """Qwen3-0.6B: the full-attention model of about the same size (28 layers, 16 query / 8 KV heads of 128)."""
    from transformers import Qwen3Config

    return Qwen3Config(
        hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True, rope_theta=1_000_000.0,
        max_position_embeddings=40960, rms_norm_eps=1e-6, bos_token_id=151643, eos_token_id=151643,
        dtype="bfloat16")


# name -> (its config, the regular tokens of its vocabulary, the default folder)
SHAPES = {
    "qwen2.5-0.5b": (qwen_shape_config, 151643, "/tmp/twostep-qwen-shape"),
    "gemma-3-1b": (gemma3_shape_config, 262144 - len(SPECIAL_TOKENS), "/tmp/twostep-gemma3-shape"),
    "qwen3-30b-a3b-mini": (qwen3_moe_shape_config, 151643, "/tmp/twostep-qwen3moe-shape"),
    "qwen3.5-0.8b": (qwen3_5_shape_config, 248320 - len(SPECIAL_TOKENS), "/tmp/twostep-qwen35-shape"),
    "qwen3-0.6b": (qwen3_shape_config, 151643, "/tmp/twostep-qwen3-shape"),
}


def parameter_counts(shape: str) -> tuple[int, int]:
    """(all parameters, those one token uses): the latter leaves out the input embedding (a token
    reads one row; a tied embedding still counts, as the lm_head) and the experts not routed to."""
    import torch
    from transformers import AutoModelForCausalLM

    config = SHAPES[shape][0]()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())      # a tied matrix once
    active = total
    if not config.tie_word_embeddings:
        active -= model.get_input_embeddings().weight.numel()
    experts = getattr(config, "num_experts", None)
    if experts:
        expert_params = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
        active -= expert_params * (experts - config.num_experts_per_tok) // experts
    return total, active


def synthetic_tokenizer(num_regular: int):
    """Byte-level BPE: the 256 byte symbols, all their pairs, then pair+byte triples up to
    num_regular tokens; Qwen2's pre-tokenizer, normaliser and decoder."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    merges = []

    def add(left: str, right: str) -> None:
        vocab[left + right] = len(vocab)
        merges.append((left, right))

    for a in alphabet:
        for b in alphabet:
            add(a, b)
    pairs = list(vocab)[len(alphabet):]
    for ab in pairs:
        for c in alphabet:
            if len(vocab) == num_regular:
                break
            add(ab, c)
    tok = Tokenizer(models.BPE(vocab, merges))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    return tok


def write_hf_folder(out: Path, shape: str, seed: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    config, num_regular, _ = SHAPES[shape]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config()).to(torch.bfloat16)
    model.save_pretrained(out)
    PreTrainedTokenizerFast(tokenizer_object=synthetic_tokenizer(num_regular), eos_token="<|endoftext|>",
                            pad_token="<|endoftext|>").save_pretrained(out)


def write_gguf(out: Path, llama_cpp_src: Path) -> None:
    script = llama_cpp_src / "convert_hf_to_gguf.py"
    if not script.is_file():
        sys.exit(f"{script} not found: unpack the llama-cpp-python sdist (docs/benchmarking.md) and "
                 "pass its vendor/llama.cpp as --llama-cpp-src or $LLAMA_CPP_SRC")
    tmp = out / (GGUF_NAME + ".part")
    # a checkpoint without Qwen3.5's multi-token-prediction layer: the converter must not look for it
    mtp = ["--no-mtp"] if "qwen3_5" in (out / "config.json").read_text() else []
    subprocess.run([sys.executable, "-c", _CONVERT, str(script), str(out), "--outtype", "bf16",
                    "--outfile", str(tmp), *mtp], check=True)
    tmp.rename(out / GGUF_NAME)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-0.5b")
    ap.add_argument("--out", default=None, help="default: /tmp/twostep-<shape>-shape")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--llama-cpp-src", default=os.environ.get("LLAMA_CPP_SRC"),
                    help="llama.cpp source tree with convert_hf_to_gguf.py")
    ap.add_argument("--no-gguf", action="store_true", help="only the HF folder")
    args = ap.parse_args()
    out = Path(args.out or SHAPES[args.shape][2])
    total, active = parameter_counts(args.shape)
    print(f"{args.shape}: {total:,} parameters, {active:,} per token")
    if all((out / f).is_file() for f in ("config.json", "model.safetensors", "tokenizer.json")):
        print(f"{out}: HF folder already there")
    else:
        out.mkdir(parents=True, exist_ok=True)
        write_hf_folder(out, args.shape, args.seed)
        print(f"{out}: HF folder written")
    if args.no_gguf:
        return
    if (out / GGUF_NAME).is_file():
        print(f"{out / GGUF_NAME}: already there")
    else:
        write_gguf(out, Path(args.llama_cpp_src or "."))
        print(f"{out / GGUF_NAME}: written")


if __name__ == "__main__":
    main()
