"""The decoder against transformers, for every supported architecture."""
from __future__ import annotations

import pytest
import torch

from conftest import ARCH_CONFIGS, engine_for, hf_greedy, load_hf, random_prompts
from twostep import SamplingParams
from twostep.engine.llm_engine import LLMEngine
from twostep.config import EngineConfig

ARCHS = list(ARCH_CONFIGS)


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_logits_match_transformers(tiny_model_dir, arch):
    folder = tiny_model_dir(arch)
    hf = load_hf(folder)
    engine = engine_for(folder)
    prompts = random_prompts([5, 40, 64], seed=2)
    for p in prompts:  # one mixed batch: three prefills side by side
        engine.add_request(p, SamplingParams(max_tokens=1))
    sched = engine.scheduler.schedule()
    assert len(sched.scheduled) == 3
    logits = engine.runner.all_logits(sched.plan)
    offset = 0
    for p in prompts:
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0].float()
        ours = logits[offset:offset + len(p)]
        offset += len(p)
        assert (ours - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("arch", ARCHS)
def test_batched_greedy_matches_transformers_alone(tiny_model_dir, arch):
    folder = tiny_model_dir(arch)
    hf = load_hf(folder)
    from twostep import LLM

    llm = LLM(str(folder), dtype="float32", kv_cache_memory="8MiB")
    prompts = random_prompts()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
                        use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, 32), f"prompt of {len(p)} tokens"
        assert o.outputs[0].finish_reason == "length"
    llm.engine.scheduler.kv.check_integrity()
    assert llm.engine.scheduler.kv.num_free_blocks == llm.engine.scheduler.kv.num_blocks


def test_unsupported_architecture_is_refused(tmp_path):
    import json

    from twostep.models.registry import config_from_hf

    cfg = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        config_from_hf(cfg)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="supports"):
        engine_for(tmp_path)


def test_unsupported_rope_scaling_is_refused():
    from twostep.models.registry import config_from_hf

    cfg = {"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8,
           "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
           "rope_scaling": {"rope_type": "proportional", "factor": 4.0}}
    with pytest.raises(ValueError, match="llama3, linear, yarn, longrope, dynamic"):
        config_from_hf(cfg)


def test_a_sliding_window_no_longer_caps_max_model_len(tmp_path):
    from conftest import make_tiny_model

    folder = make_tiny_model(tmp_path / "m", "mistral", sliding_window=128)
    engine = engine_for(folder)
    assert engine.max_model_len == 512      # max_position_embeddings: the window is attention's, not a limit
    assert engine_for(folder, max_model_len=256).max_model_len == 256


def test_sharded_safetensors_load_identically(tmp_path, tiny_model_dir):
    import transformers

    folder = tiny_model_dir("qwen3")
    hf = load_hf(folder)
    sharded = tmp_path / "sharded"
    hf.save_pretrained(sharded, max_shard_size="100KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (sharded / name).write_bytes((folder / name).read_bytes())
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("model-*.safetensors"))) > 1
    from twostep import LLM

    prompts = random_prompts([9, 21], seed=3)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    a = LLM(str(folder), dtype="float32", kv_cache_memory="4MiB").generate(prompts, params, use_tqdm=False)
    b = LLM(str(sharded), dtype="float32", kv_cache_memory="4MiB").generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    del transformers


def test_hub_id_offline_fails_clearly(monkeypatch):
    from twostep.models.loader import resolve_model_path

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="could not fetch model 'no-such-org/no-such-model'"):
        resolve_model_path("no-such-org/no-such-model")
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model_path("/definitely/missing/model.gguf")


def test_generation_config_gives_default_sampling(tmp_path):
    import json

    from conftest import make_tiny_model

    folder = make_tiny_model(tmp_path / "g", "llama")
    gen = json.loads((folder / "generation_config.json").read_text())
    gen.update(do_sample=True, temperature=0.6, top_p=0.9, top_k=20, eos_token_id=[2, 7])
    (folder / "generation_config.json").write_text(json.dumps(gen))
    engine = engine_for(folder)
    p = engine.default_sampling_params()
    assert (p.temperature, p.top_p, p.top_k) == (0.6, 0.9, 20)
    assert {2, 7} <= engine.eos_token_ids
    gen["do_sample"] = False
    (folder / "generation_config.json").write_text(json.dumps(gen))
    assert engine_for(folder).default_sampling_params().greedy


@pytest.mark.parametrize("arch,attention_bias,qkv,o", [
    ("LlamaForCausalLM", True, True, True), ("Qwen3ForCausalLM", True, True, True),
    ("Qwen2ForCausalLM", False, True, False), ("MistralForCausalLM", True, False, False),
    ("LlamaForCausalLM", False, False, False),
])
def test_attention_bias_switches(arch, attention_bias, qkv, o):
    from twostep.models.registry import config_from_hf

    cfg = config_from_hf({"architectures": [arch], "vocab_size": 10, "hidden_size": 8,
                               "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
                               "attention_bias": attention_bias})
    assert (cfg.qkv_bias, cfg.o_bias) == (qkv, o)


def test_missing_config_field_and_unused_tensors_are_refused(tmp_path, tiny_model_dir):
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from twostep.models.registry import config_from_hf

    with pytest.raises(ValueError, match="num_attention_heads"):
        config_from_hf({"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8,
                             "intermediate_size": 8, "num_hidden_layers": 1})
    folder = tmp_path / "extra"
    shutil.copytree(tiny_model_dir("llama"), folder)
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(64)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="o_proj.bias"):
        engine_for(folder)
    del json


def test_prepacked_bf16_linears_are_bit_identical(tiny_model_dir):
    from twostep.platforms.cpu.linear import PackedLinearMethod, can_prepack

    if not can_prepack(torch.bfloat16, torch.device("cpu")):
        pytest.skip("this CPU has no native bf16 in oneDNN")
    folder = tiny_model_dir("qwen2")   # with q/k/v biases
    prompts = random_prompts([5, 40], seed=4)
    logits, tokens = {}, {}
    for packed in (False, True):
        engine = LLMEngine(EngineConfig(model=str(folder), dtype="bfloat16", kv_cache_memory="4MiB",
                                        cpu_prepack_weights=packed, cpu_gemv=False,
                                        enable_prefix_caching=False))
        assert any(isinstance(getattr(m, "method", None), PackedLinearMethod)
                   for m in engine.model.modules()) == packed
        for p in prompts:
            engine.add_request(p, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        logits[packed] = engine.runner.all_logits(engine.scheduler.schedule().plan)
        engine.abort_request(list(engine.scheduler.requests), emit_output=False)
        ids = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
               for p in prompts]
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o for o in engine.step() if o.finished})
        tokens[packed] = [done[i].outputs[0].token_ids for i in ids]
    assert torch.equal(logits[False], logits[True])
    assert tokens[False] == tokens[True]


def test_incomplete_checkpoint_names_the_missing_tensor(tmp_path, tiny_model_dir):
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tmp_path / "partial"
    shutil.copytree(tiny_model_dir("llama"), folder)
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="layers.1.self_attn.k_proj.weight"):
        engine_for(folder)
