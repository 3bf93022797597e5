"""qwen2 and qwen3 GGUF files (q/k/v biases; q/k norms and an explicit head size), written here from
tiny HF models the way llama.cpp's converter writes them (llama.cpp permutes the Q/K rows of llama
files only), load and run as transformers runs the same weights."""
from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
import torch
from safetensors.torch import load_file

from conftest import VOCAB, engine_for, gguf_name, hf_greedy, load_hf, random_prompts

CHAT_TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"


def write_gguf(folder: Path, path: Path, arch: str, extra_tensor: str | None = None) -> Path:
    cfg = json.loads((folder / "config.json").read_text())
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    rope = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
    writer.add_rope_freq_base(cfg.get("rope_theta") or rope["rope_theta"])
    if rope.get("rope_type", "default") == "linear":          # the tiny qwen3's
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    tok = json.loads((folder / "tokenizer.json").read_text())["model"]
    tokens = sorted(tok["vocab"], key=tok["vocab"].get)
    tokens += [f"<|unused{i}|>" for i in range(VOCAB - len(tokens))]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t.startswith("<") else 1 for t in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["merges"]])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    writer.add_chat_template(CHAT_TEMPLATE)
    tensors = load_file(folder / "model.safetensors")
    if extra_tensor:
        tensors[extra_tensor] = torch.zeros(cfg["hidden_size"])
    for name, value in tensors.items():
        writer.add_tensor(gguf_name(name), value.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_a_qwen_gguf_runs_as_transformers_runs_its_weights(tiny_model_dir, tmp_path, arch):
    folder = tiny_model_dir(arch)
    path = write_gguf(folder, tmp_path / f"{arch}.gguf", arch)
    hf = load_hf(folder)
    engine = engine_for(path)
    assert engine.model_config.architecture == {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[arch]
    assert engine.model_config.qkv_bias == (arch == "qwen2") and (engine.model_config.qk_norm == "head") == (arch == "qwen3")
    prompt = random_prompts([23], seed=5)[0]
    engine.add_request(prompt)
    ours = engine.runner.all_logits(engine.scheduler.schedule().plan)
    with torch.no_grad():
        theirs = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    engine.abort_request(list(engine.scheduler.requests), emit_output=False)
    from twostep import SamplingParams

    prompts = random_prompts([5, 17, 40], seed=6)
    ids = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)) for p in prompts]
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert [done[i].outputs[0].token_ids for i in ids] == [hf_greedy(hf, p, 16) for p in prompts]
    assert engine.tokenizer.get_chat_template() == CHAT_TEMPLATE


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_transformers_reads_the_written_file_the_same_way(tiny_model_dir, tmp_path, arch):
    """The file follows llama.cpp's conventions, not only ours: transformers' own GGUF loader
    gives the same logits."""
    import transformers

    from conftest import make_tiny_model

    # transformers' GGUF reader ignores key_length (it builds Qwen3Config's default head size, 128)
    # and rope scaling: a qwen3 it can read
    folder = tiny_model_dir(arch) if arch == "qwen2" else make_tiny_model(
        tmp_path / "hf", arch, head_dim=128, rope_scaling=None)
    path = write_gguf(folder, tmp_path / f"{arch}.gguf", arch)
    from_gguf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
    prompt = torch.tensor([random_prompts([11], seed=7)[0]])
    with torch.no_grad():
        torch.testing.assert_close(from_gguf(prompt).logits, load_hf(folder)(prompt).logits,
                                   rtol=1e-4, atol=1e-4)


def test_a_tensor_the_architecture_does_not_have_is_refused(tiny_model_dir, tmp_path):
    folder = tiny_model_dir("qwen2")
    path = write_gguf(folder, tmp_path / "odd.gguf", "qwen2",
                      extra_tensor="model.layers.0.self_attn.q_norm.weight")   # a qwen3 tensor
    with pytest.raises(ValueError, match=r"odd\.gguf.*unexpected tensor 'blk\.0\.attn_q_norm\.weight' for a qwen2"):
        engine_for(path)


def test_a_truncated_file_names_itself(tiny_model_dir, tmp_path):
    path = write_gguf(tiny_model_dir("qwen3"), tmp_path / "cut.gguf", "qwen3")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="cut.gguf"):
        engine_for(path)
