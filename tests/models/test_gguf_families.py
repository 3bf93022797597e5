"""GGUF files of the families beyond llama and qwen (gemma2, gemma3, phi3, smollm3, olmo2, granite,
glm4, llama with attention biases, the MoE families, and the hybrids Qwen3.5, Qwen3.5-MoE and
Qwen3-Next), written by llama.cpp's own converter from tiny random HF models: in f32 they run as
transformers (and twostep) run the HF checkpoint; their Q8_0 files (the converter's) and Q4_0 files
(llama-quantize's) run as the same file dequantized at load.

The converter, $LLAMA_CPP_SRC/convert_hf_to_gguf.py, runs unchanged but for the vocabulary: the tiny
models' BPE tokenizer has a pre-tokenizer hash it does not know (it raises), and its Gemma 2 and
Phi-3 writers want a sentencepiece model, so every family's vocabulary is written the converter's
GPT-2 way (`_set_vocab_gpt2`, pre-tokenizer "gpt-2", which is what the tiny tokenizer is). Tensors
and metadata are the converter's own.

A setting a GGUF file cannot hold is built into the tiny model with the value llama.cpp assumes
(CASES): Gemma 2's query_pre_attn_scalar (llama.cpp scales by the head size), Gemma 3's layer
pattern (the converter writes none: every 6th layer full), SmolLM3's NoPE layers (every 4th),
Phi-3's LongRoPE attention factor (the converter computes it from max / original context, HF from
`factor`: made to agree), and Qwen3-Next's experts (llama.cpp's qwen3next has them in every layer).
The hybrids' norms are randomised (HF starts them all alike: 0 for a 1 + w norm, 1 for the gated
one), and Qwen3.5's checkpoint gets a multi-token prediction block (mtp.*: the converter writes it
as a block past the last, which is not loaded); the others are converted with --no-mtp (without
it the converter refuses a Qwen3.5 / Qwen3-Next checkpoint that lacks the block). The Gemma 3
converter drops the embedding rows past the tokenizer's real vocabulary (371 of 384 here), so its
greedy tokens are compared with transformers' over those rows.

Without $LLAMA_CPP_SRC the conversion tests skip; without llama-quantize ($LLAMA_CPP_BIN_DIR) the
Q4_0 ones do. The refusal tests at the end write their files with the gguf package and need neither.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from conftest import VOCAB, engine_for, load_hf, make_tiny_model, random_prompts
from twostep import SamplingParams
from twostep.models.gguf_loader import SUPPORTED_ARCHITECTURES, load_gguf
from twostep.quantization.packed import QuantizedWeight

_INT16 = {"cpu_int8_activations": "off"}
# case -> (ARCH_CONFIGS key, overrides a GGUF file can express, engine settings)
CASES = {
    "gemma2": ("gemma2", {"query_pre_attn_scalar": 32}, {}),
    "gemma3": ("gemma3", {"num_hidden_layers": 6, "layer_types": None}, {}),
    "phi3": ("phi3", {}, {}),
    # the short factors: a context within the original 128 positions, as transformers' for these prompts
    "phi3-longrope": ("phi3-longrope", {"max_position_embeddings": 512, "original_max_position_embeddings": 128},
                      {"max_model_len": 128}),
    "smollm3": ("smollm3", {"num_hidden_layers": 4, "no_rope_layer_interval": 4, "no_rope_layers": None}, {}),
    "olmo2": ("olmo2", {}, {}),
    "granite": ("granite", {}, {}),
    "glm4": ("glm4", {}, {}),
    "llama-bias": ("llama-bias", {}, {}),     # Q/K biases permuted by the converter like the weights
    # experts stacked [E, n, k] per projection; llama.cpp's qwen3moe has experts in every layer.
    # int16 activations: a router's choice near a tie flips under int8 ones (MOE below)
    "qwen3-moe": ("qwen3-moe", {"mlp_only_layers": []}, _INT16),
    "mixtral": ("mixtral", {}, _INT16),          # a llama file with experts
    "gpt-oss": ("gpt-oss", {}, _INT16),          # sinks, expert biases, YaRN without truncation
    "olmoe": ("olmoe", {}, _INT16),              # q/k norms over all heads, weights not renormalised
    # value heads tiled over the key heads in the file (undone); heads of 32 dims (llama.cpp wants
    # key and value heads alike): packed, out_proj's columns move as whole blocks
    "qwen3.5": ("qwen3.5", {"linear_key_head_dim": 32, "linear_value_head_dim": 32}, {}),
    # heads of 16 dims: a packed out_proj's columns cannot be reordered, it is dequantized
    "qwen3.5-moe": ("qwen3.5-moe", {}, _INT16),
    "qwen3-next": ("qwen3-next", {"decoder_sparse_step": 1}, _INT16),     # in_proj_ba cut per key head
}
MOE = ("qwen3-moe", "mixtral", "gpt-oss", "olmoe", "qwen3.5-moe", "qwen3-next")
HYBRID = ("qwen3.5", "qwen3.5-moe", "qwen3-next")
WITH_MTP = ("qwen3.5",)
PROMPT_LENGTHS = [5, 17, 40]
NEW_TOKENS = 16

# llama.cpp's converter with the vocabulary written the GPT-2 way; argv: source folder, JSON list of
# [model folder, output file, outtype, converter flags...]. One process for all: torch and
# transformers load once (--no-mtp sets a class attribute: undone for the next file).
_CONVERT = r"""
import json, runpy, sys
src, jobs = sys.argv[1], json.loads(sys.argv[2])
sys.path[:0] = [src, src + "/gguf-py"]
import conversion
from conversion.base import TextModel
model_class = conversion.get_model_class
def gpt2_vocabulary(name, mmproj=False):
    cls = model_class(name, mmproj)
    cls.set_vocab = TextModel._set_vocab_gpt2
    if getattr(cls, "supports_mtp_export", False):
        cls.no_mtp = False
    return cls
conversion.get_model_class = gpt2_vocabulary
TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
for folder, outfile, outtype, *flags in jobs:
    sys.argv = [src + "/convert_hf_to_gguf.py", folder, "--outfile", outfile, "--outtype", outtype, *flags]
    runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _llama_cpp_src() -> Path:
    src = os.environ.get("LLAMA_CPP_SRC")
    if not src:
        pytest.skip("LLAMA_CPP_SRC is not set: llama.cpp's source (convert_hf_to_gguf.py) converts the models")
    if not (Path(src) / "convert_hf_to_gguf.py").is_file():
        pytest.skip(f"LLAMA_CPP_SRC={src} has no convert_hf_to_gguf.py")
    return Path(src)


def _llama_quantize() -> Path:
    found = Path(os.environ.get("LLAMA_CPP_BIN_DIR", "")) / "llama-quantize"
    if not os.environ.get("LLAMA_CPP_BIN_DIR") or not found.is_file():
        which = shutil.which("llama-quantize")
        if which is None:
            pytest.skip("llama-quantize not found (set LLAMA_CPP_BIN_DIR to llama.cpp's bin folder)")
        found = Path(which)
    return found


def _hybrid_checkpoint(folder: Path, mtp: bool) -> None:
    """Random norms (HF's are 0: 1 + w would be 1 with or without the 1), and with `mtp` a multi-token
    prediction block as Qwen3.5's checkpoints have it (mtp.*), its layer a full attention layer's
    tensors plus noise."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    rng = torch.Generator().manual_seed(1)
    noise = lambda t: torch.randn(t.shape, generator=rng) * 0.3
    tensors = {n: t + noise(t) if n.endswith("norm.weight") else t for n, t in tensors.items()}
    if mtp:
        hidden, full = config["hidden_size"], config["layer_types"].index("full_attention")
        tensors |= {f"mtp.{n}.weight": noise(torch.empty(hidden)) for n in
                    ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}
        tensors["mtp.fc.weight"] = noise(torch.empty(hidden, 2 * hidden))
        prefix = f"model.layers.{full}."
        tensors |= {"mtp.layers.0." + n[len(prefix):]: t + noise(t) for n, t in list(tensors.items())
                    if n.startswith(prefix)}
        (folder / "config.json").write_text(json.dumps({**config, "mtp_num_hidden_layers": 1}))
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def _converter_flags(src: Path, case: str) -> list[str]:
    """--no-mtp for a hybrid without the MTP block, where the converter knows the flag."""
    knows = "--no-mtp" in (src / "convert_hf_to_gguf.py").read_text()
    return ["--no-mtp"] if case in HYBRID and case not in WITH_MTP and knows else []


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """case -> (HF folder, folder of its GGUF files: f32.gguf, q8_0.gguf)."""
    src = _llama_cpp_src()
    root = tmp_path_factory.mktemp("gguf-families")
    out = {case: (make_tiny_model(root / case / "hf", arch, **overrides), root / case)
           for case, (arch, overrides, _) in CASES.items()}
    for case in HYBRID:
        _hybrid_checkpoint(out[case][0], mtp=case in WITH_MTP)
    jobs = [[str(hf), str(files / f"{t}.gguf"), t, *_converter_flags(src, case)]
            for case, (hf, files) in out.items() for t in ("f32", "q8_0")]
    run = subprocess.run([sys.executable, "-c", _CONVERT, str(src), json.dumps(jobs)],
                         check=False, capture_output=True, text=True, timeout=600)
    if run.returncode != 0:
        pytest.fail(f"llama.cpp's converter failed ({run.returncode}):\n{run.stderr[-6000:]}")
    return out


def _gguf_file(converted, case: str, qtype: str) -> Path:
    files = converted[case][1]
    if qtype in ("f32", "q8_0"):
        return files / f"{qtype}.gguf"
    path = files / f"{qtype}.gguf"
    if not path.is_file():
        run = subprocess.run([str(_llama_quantize()), str(files / "f32.gguf"), str(path), qtype.upper()],
                             check=False, capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return path


def _engine(path: Path, case: str, **kw):
    return engine_for(path, **CASES[case][2], **kw)


def _prefill_logits(engine, prompt: list[int]) -> torch.Tensor:
    engine.add_request(prompt)
    logits = engine.runner.all_logits(engine.scheduler.schedule().plan)
    engine.abort_request(list(engine.scheduler.requests), emit_output=False)
    return logits


def _int8_decodes(engine, bits: int) -> bool:
    """Whether the engine's decode steps round the activations of its `bits`-bit linears to int8."""
    return any(bits in getattr(m.method, "int8_bits", ()) for m in engine.model.modules()
               if getattr(m, "quantized", None) is not None)


def _greedy(engine, prompts: list[list[int]], vocab: int = VOCAB) -> list[list[int]]:
    allowed = None if vocab == VOCAB else list(range(vocab))
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, allowed_token_ids=allowed)
    ids = [engine.add_request(p, params) for p in prompts]
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return [list(done[i].outputs[0].token_ids) for i in ids]


def _hf_greedy(hf, prompt: list[int], vocab: int) -> list[int]:
    """transformers' greedy tokens, over the first `vocab` logits (the rows the GGUF file kept)."""
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                      pad_token_id=0, suppress_tokens=list(range(vocab, VOCAB)) or None)
    return out[0, len(prompt):].tolist()


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_a_converted_file_runs_as_transformers_runs_the_checkpoint(converted, case):
    folder, _ = converted[case]
    engine = _engine(_gguf_file(converted, case, "f32"), case)
    hf = load_hf(folder)
    assert engine.model_config.architecture == hf.config.architectures[0]
    vocab = engine.model_config.vocab_size
    assert vocab < VOCAB if case == "gemma3" else vocab == VOCAB     # Gemma 3: rows past the real vocabulary dropped
    prompt = random_prompts([23], seed=5, vocab=vocab)[0]
    with torch.no_grad():
        theirs = hf(torch.tensor([prompt])).logits[0, :, :vocab]
    torch.testing.assert_close(_prefill_logits(engine, prompt), theirs, rtol=1e-4, atol=1e-4)

    prompts = random_prompts(PROMPT_LENGTHS, seed=6, vocab=vocab)
    expected = [_hf_greedy(hf, p, vocab) for p in prompts]
    assert _greedy(engine, prompts) == expected
    assert _greedy(_engine(folder, case), prompts, vocab) == expected     # twostep on the HF folder


@pytest.mark.slow
@pytest.mark.parametrize("case", HYBRID)
def test_a_hybrid_file_loads_what_its_checkpoint_loads(converted, case):
    """Tensor by tensor: value heads untiled (Qwen3.5), A_log from -exp(A_log), the convolution
    unsqueezed, q_proj cut into query and gate per head, Qwen3-Next's b/a per key head, the norms'
    folded 1 + w (all but the gated norm's) as the family's from_hf makes them; the MTP layer skipped."""
    from twostep.models.loader import load_checkpoint

    folder, files = converted[case]
    theirs = load_checkpoint(str(folder), torch.float32)
    ckpt = load_gguf(files / "f32.gguf")
    fields = gguf.GGUFReader(str(files / "f32.gguf")).fields
    blocks = fields[f"{fields['general.architecture'].contents()}.block_count"].contents()
    assert blocks == theirs.config.num_layers + (case in WITH_MTP)
    assert ckpt.hf_config["num_hidden_layers"] == theirs.config.num_layers
    assert ckpt.tensors.keys() == theirs.tensors.keys()
    for name, t in theirs.tensors.items():
        torch.testing.assert_close(ckpt.tensors[name], t, rtol=0, atol=1e-6, msg=name)


# Decode steps multiply packed weights with quantized activations: int16 (2e-4 of a product's
# scale) or int8 (2e-2: tests/quantization's INT8_RTOL), summed over the layers. Both runs hold the
# file's weights, so only the activations' rounding tells them apart, and by default (decode) it is
# int8 for the code widths the int8 product takes: 4-bit codes wherever it is built, 8-bit ones only
# with VNNI (AVX2 alone keeps Q8_0 on the int16 passes). So a packed run's greedy token may differ
# from the dequantized run's where two logits nearly tie: each token the packed run picks must be
# within this fraction of the logits' scale of the dequantized run's best on the same sequence (the
# tiny models' worst: 0 for Q8_0 with int16 activations, 2.4% for Q4_0; with int8 ones, AVX512-VNNI:
# 3.4% for Q8_0, Qwen3.5).
GREEDY_GAP = {"q8_0": 0.002, "q4_0": 0.05}       # int16 activations
INT8_GREEDY_GAP = 0.05
PREFILL_ATOL = 1e-3     # times the logits' scale: prefill dequantizes packed weights to float32


@pytest.mark.slow
@pytest.mark.parametrize("qtype", ["q8_0", "q4_0"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_quantized_file_runs_as_itself_dequantized(converted, case, qtype):
    path = _gguf_file(converted, case, qtype)
    packed, plain = load_gguf(path), load_gguf(path, keep_quantized=False)
    assert packed.tensors.keys() == plain.tensors.keys()
    kept = [name for name, t in packed.tensors.items() if isinstance(t, QuantizedWeight)]
    assert any(".q_proj." in name for name in kept) and any(".up_proj." in name for name in kept)
    for name in kept:       # cut, reordered and packed, the same numbers as the float path
        torch.testing.assert_close(packed.tensors[name].dequantize(), plain.tensors[name], rtol=0, atol=0, msg=name)

    if case in HYBRID:      # cut per head, rows reordered: packed all the same
        assert any(".linear_attn.in_proj_qkv." in n for n in kept) and any(".self_attn.gate_proj." in n for n in kept)
        # Qwen3.5-MoE's value heads (16 dims) are narrower than a block: its out_proj columns are reordered in float
        out_proj = packed.tensors["model.layers.0.linear_attn.out_proj.weight"]
        assert isinstance(out_proj, QuantizedWeight) == (case != "qwen3.5-moe")

    packed, plain = _engine(path, case), _engine(path, case, quantization="none")
    vocab = packed.model_config.vocab_size
    prompt = random_prompts([23], seed=5, vocab=vocab)[0]
    reference = _prefill_logits(plain, prompt)
    scale = reference.abs().max().item()
    torch.testing.assert_close(_prefill_logits(packed, prompt), reference, rtol=0, atol=PREFILL_ATOL * scale)

    prompts = random_prompts(PROMPT_LENGTHS, seed=6, vocab=vocab)
    greedy = _greedy(packed, prompts)
    gap = INT8_GREEDY_GAP if _int8_decodes(packed, {"q8_0": 8, "q4_0": 4}[qtype]) else GREEDY_GAP[qtype]
    for prompt, tokens in zip(prompts, greedy):
        logits = _prefill_logits(plain, prompt + tokens[:-1])[len(prompt) - 1:]
        gaps = logits.max(-1).values - logits[torch.arange(len(tokens)), torch.tensor(tokens)]
        assert gaps.max().item() <= gap * logits.abs().max().item(), (prompt, tokens, gaps)
    if case in MOE:     # the experts kernel with int16 activations: the dequantized model's tokens
        assert greedy == _greedy(plain, prompts)


# ---- what is refused, by name: small files written here -----------------------------------------

def _write(path: Path, arch: str, layers: dict | list[dict] | None = None, num_layers: int = 1,
           heads: int = 2, head_dim: int = 4, **metadata) -> Path:
    """A tiny file of `arch`: hidden 8, vocabulary 8, and the given block tensors (torch shapes, random,
    or arrays) in every layer (a list: layer by layer); metadata (after "{arch}.") as keyword
    arguments, dots spelled "__"."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(num_layers)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(heads)
    writer.add_head_count_kv(1)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(1e-6)
    for key, value in metadata.items():
        key = f"{arch}.{key.replace('__', '.')}"
        if isinstance(value, list):
            writer.add_array(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint32(key, value)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(["a", "b", "c", "d", "e", "f", "g", "ab"])
    writer.add_token_merges(["a b"])
    rng = np.random.default_rng(0)
    writer.add_tensor("token_embd.weight", rng.standard_normal((8, 8), dtype=np.float32))
    writer.add_tensor("output_norm.weight", np.ones(8, dtype=np.float32))
    for i in range(num_layers):
        for name, shape in ((layers[i] if isinstance(layers, list) else layers) or {}).items():
            value = shape if isinstance(shape, np.ndarray) else rng.standard_normal(shape, dtype=np.float32)
            writer.add_tensor(f"blk.{i}.{name}", value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# Gemma 3 layer tensors, torch shapes: hidden 8, 2 query heads and 1 KV head of 4 dims, MLP 16
GEMMA3_LAYER = {"attn_norm.weight": (8,), "attn_q.weight": (8, 8), "attn_k.weight": (4, 8),
                "attn_v.weight": (4, 8), "attn_output.weight": (8, 8), "attn_q_norm.weight": (4,),
                "attn_k_norm.weight": (4,), "post_attention_norm.weight": (8,), "ffn_norm.weight": (8,),
                "ffn_gate.weight": (16, 8), "ffn_up.weight": (16, 8), "ffn_down.weight": (8, 16),
                "post_ffw_norm.weight": (8,)}


@pytest.mark.parametrize("metadata, layer_types, window", [
    ({"attention__sliding_window": 4}, "SSS", 4),                    # llama.cpp's default: every 6th full
    ({"attention__sliding_window": 4, "attention__sliding_window_pattern": 2}, "SFS", 4),
    ({"attention__sliding_window": 4, "attention__sliding_window_pattern": [False, True, True]}, "FSS", 4),
    ({}, "FFF", None),                                               # no window: every layer full
])
def test_gemma3_sliding_layers_follow_llama_cpps_pattern(tmp_path, metadata, layer_types, window):
    ckpt = load_gguf(_write(tmp_path / "g.gguf", "gemma3", GEMMA3_LAYER, num_layers=3, **metadata))
    cfg = ckpt.hf_config
    assert [t[0].upper() for t in cfg["layer_types"]] == list(layer_types)
    assert cfg["sliding_window"] == window
    assert cfg["query_pre_attn_scalar"] == 4 and cfg["rope_local_base_freq"] == 10000.0   # llama.cpp's defaults
    # the norms are used as the file has them (the converter folded Gemma's 1 + w into them)
    raw = {t.name: t.data for t in gguf.GGUFReader(str(tmp_path / "g.gguf")).tensors}
    assert torch.equal(ckpt.tensors["model.layers.0.pre_feedforward_layernorm.weight"],
                       torch.from_numpy(raw["blk.0.ffn_norm.weight"].copy()))


def test_a_tensor_the_architecture_does_not_have_is_refused(tmp_path):
    path = _write(tmp_path / "odd.gguf", "gemma2", GEMMA3_LAYER)      # q/k norms: Gemma 3's, not Gemma 2's
    with pytest.raises(ValueError, match=r"odd\.gguf.*unexpected tensor 'blk\.0\.attn_q_norm\.weight' for a gemma2"):
        load_gguf(path)


@pytest.mark.parametrize("arch, metadata, message", [
    ("olmo2", {"attention__sliding_window": 4}, "OLMo 3"),
    ("glm4", {"rope__dimension_sections": [2, 2, 0, 0]}, "M-RoPE"),
    ("granite", {"rope__dimension_count": 2}, "partial rotary embeddings .* not supported for granite"),
    ("phi3", {"rope__dimension_count": 3}, "partial rotary embeddings .* an even part of it"),
])
def test_what_the_model_would_run_differently_is_refused(tmp_path, arch, metadata, message):
    with pytest.raises(ValueError, match=rf"{arch}\.gguf: .*{message}"):
        load_gguf(_write(tmp_path / f"{arch}.gguf", arch, **metadata))


def test_an_unknown_architecture_names_the_supported_ones(tmp_path):
    with pytest.raises(ValueError, match="'gemma4' is not supported; supported: llama, .*glm4"):
        load_gguf(_write(tmp_path / "x.gguf", "gemma4"))
    assert {"gemma2", "gemma3", "phi3", "smollm3", "olmo2", "granite", "glm4"} <= set(SUPPORTED_ARCHITECTURES)


# a Qwen3-MoE layer, torch shapes: hidden 8, 2 query heads and 1 KV head of 4 dims, 4 experts of 16
QWEN3MOE_LAYER = {"attn_norm.weight": (8,), "attn_q.weight": (8, 8), "attn_k.weight": (4, 8),
                  "attn_v.weight": (4, 8), "attn_output.weight": (8, 8), "attn_q_norm.weight": (4,),
                  "attn_k_norm.weight": (4,), "ffn_norm.weight": (8,), "ffn_gate_inp.weight": (4, 8),
                  "ffn_gate_exps.weight": (4, 16, 8), "ffn_up_exps.weight": (4, 16, 8),
                  "ffn_down_exps.weight": (4, 8, 16)}


def test_experts_load_stacked(tmp_path):
    ckpt = load_gguf(_write(tmp_path / "m.gguf", "qwen3moe", QWEN3MOE_LAYER, expert_count=4, expert_used_count=2,
                            expert_feed_forward_length=16))
    cfg = ckpt.hf_config
    assert (cfg["num_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"]) == (4, 2, 16)
    assert ckpt.tensors["model.layers.0.mlp.experts.gate_proj.weight"].shape == (64, 8)
    assert ckpt.tensors["model.layers.0.mlp.experts.down_proj.weight"].shape == (32, 16)


@pytest.mark.parametrize("metadata, message", [
    ({"expert_count": 5, "expert_used_count": 2}, r"tensor 'blk\.0\.ffn_gate_inp\.weight' holds 4 experts; qwen3moe\.expert_count says 5"),
    ({"expert_count": 4, "expert_used_count": 5}, r"qwen3moe\.expert_used_count is 5; a token takes 1 to expert_count \(4\)"),
    ({"expert_count": 4, "expert_used_count": 0}, r"qwen3moe\.expert_used_count is 0"),
])
def test_an_expert_count_or_top_k_the_tensors_contradict_is_refused(tmp_path, metadata, message):
    with pytest.raises(ValueError, match=rf"m\.gguf: {message}"):
        load_gguf(_write(tmp_path / "m.gguf", "qwen3moe", QWEN3MOE_LAYER, expert_feed_forward_length=16, **metadata))


# Qwen3-Next layers, torch shapes: hidden 8, MLP 16; a Gated DeltaNet of 2 key heads and 4 value heads
# of 2 dims (16 conv channels), then gated attention of 2 query heads (query and gate rows) and 1 KV head of 4
_NORMS_MLP = {"attn_norm.weight": (8,), "post_attention_norm.weight": (8,), "ffn_gate.weight": (16, 8),
              "ffn_up.weight": (16, 8), "ffn_down.weight": (8, 16)}
QWEN3NEXT_LINEAR = {**_NORMS_MLP, "attn_qkv.weight": (16, 8), "attn_gate.weight": (8, 8), "ssm_ba.weight": (8, 8),
                    "ssm_conv1d.weight": (16, 4), "ssm_dt.bias": (4,), "ssm_a": -np.arange(1, 5, dtype=np.float32),
                    "ssm_norm.weight": (2,), "ssm_out.weight": (8, 8)}
QWEN3NEXT_FULL = {**_NORMS_MLP, "attn_q.weight": (16, 8), "attn_k.weight": (4, 8), "attn_v.weight": (4, 8),
                  "attn_output.weight": (8, 8), "attn_q_norm.weight": (4,), "attn_k_norm.weight": (4,)}
_SSM = {"ssm__conv_kernel": 4, "ssm__state_size": 2, "ssm__group_count": 2, "ssm__time_step_rank": 4,
        "ssm__inner_size": 8, "rope__dimension_count": 2}


def test_a_hybrid_file_without_recurrent_layers_takes_every_nth_layer_full(tmp_path):
    """Without attention.recurrent_layers, llama.cpp's full_attention_interval; the tensors in the
    forms the family's layers take (raw: the file's)."""
    path = _write(tmp_path / "n.gguf", "qwen3next", [QWEN3NEXT_LINEAR, QWEN3NEXT_FULL], num_layers=2,
                  full_attention_interval=2, **_SSM)
    ckpt = load_gguf(path)
    cfg = ckpt.hf_config
    assert cfg["layer_types"] == ["linear_attention", "full_attention"]
    assert (cfg["linear_num_key_heads"], cfg["linear_num_value_heads"], cfg["linear_key_head_dim"],
            cfg["linear_value_head_dim"], cfg["linear_conv_kernel_dim"], cfg["partial_rotary_factor"]) == (2, 4, 2, 2, 4, 0.5)
    raw = {t.name: torch.from_numpy(np.array(t.data)) for t in gguf.GGUFReader(str(path)).tensors}
    t = {n.removeprefix("model.layers."): w for n, w in ckpt.tensors.items()}
    torch.testing.assert_close(t["0.linear_attn.A_log"], torch.log(torch.arange(1.0, 5.0)))
    assert torch.equal(t["0.linear_attn.conv1d.weight"], raw["blk.0.ssm_conv1d.weight"].unsqueeze(1))
    # per key head: its value heads' b, then their a
    assert torch.equal(t["0.linear_attn.in_proj_b.weight"], raw["blk.0.ssm_ba.weight"][[0, 1, 4, 5]])
    assert torch.equal(t["0.linear_attn.in_proj_a.weight"], raw["blk.0.ssm_ba.weight"][[2, 3, 6, 7]])
    # per head: its query, then its gate
    assert torch.equal(t["1.self_attn.q_proj.weight"], raw["blk.1.attn_q.weight"][[0, 1, 2, 3, 8, 9, 10, 11]])
    assert torch.equal(t["1.self_attn.gate_proj.weight"], raw["blk.1.attn_q.weight"][[4, 5, 6, 7, 12, 13, 14, 15]])
    assert "1.linear_attn.in_proj_qkv.weight" not in t and "0.self_attn.q_proj.weight" not in t


def test_a_hybrid_layer_with_the_other_kinds_tensors_is_refused(tmp_path):
    path = _write(tmp_path / "n.gguf", "qwen3next", [QWEN3NEXT_FULL, QWEN3NEXT_FULL], num_layers=2,
                  full_attention_interval=2, **_SSM)
    with pytest.raises(ValueError, match=r"unexpected tensor 'blk\.0\.attn_q\.weight' for a qwen3next"):
        load_gguf(path)
