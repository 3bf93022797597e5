"""`twostep analyze` of mixture-of-experts models: total parameters (every expert, what memory holds)
against active ones (what a token runs through: its FLOPs and decode's weight bytes at batch 1)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from twostep.analysis import Hardware, analyze, format_report, to_json
from twostep.analysis.roofline import routed_intensity
from twostep.cli import main


def _moe_config(**overrides) -> dict:
    """Qwen3-MoE: hidden 16, 2 query heads and 1 KV head of 8, vocabulary 100 (untied); layer 0
    routes to 2 of 4 experts of 6, layer 1 is a dense MLP of 20 (mlp_only_layers)."""
    return {"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 16, "intermediate_size": 20,
            "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
            "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 6, "mlp_only_layers": [1],
            "vocab_size": 100, "max_position_embeddings": 4096, "tie_word_embeddings": False,
            "torch_dtype": "float32", **overrides}


# counted by hand for _moe_config
ATTENTION = 16 * (16 + 2 * 8) + 16 * 16 + 2 * 8 + 2 * 16     # q, k, v, o; q/k norms; two RMSNorms = 816
EXPERT = 3 * 16 * 6                                            # gate, up, down = 288
ROUTER = 4 * 16
DENSE_MLP = 3 * 16 * 20
TOTAL = 100 * 16 * 2 + 16 + 2 * ATTENTION + ROUTER + 4 * EXPERT + DENSE_MLP      # embedding, head, final norm
ACTIVE = TOTAL - 4 * EXPERT + 2 * EXPERT                                          # 2 of the 4 experts
KV = 2 * 2 * 1 * 8 * 4                                          # K and V, 2 layers, 1 KV head of 8, fp32


def _hardware(memory: int = 10**12) -> Hardware:
    return Hardware("test", "test", 1e12, 1e11, memory, "made up for a test")


def test_tiny_moe_counts_by_hand():
    m = analyze(_moe_config()).model
    p = m.params
    assert (TOTAL, ACTIVE) == (7024, 6448)
    assert p.total == TOTAL and p.active == ACTIVE and m.num_params == TOTAL and m.active_params == ACTIVE
    assert (p.num_experts, p.experts_per_tok, p.moe_layers) == (4, 2, 1)
    assert (p.expert, p.experts, p.routers) == (EXPERT, 4 * EXPERT, ROUTER)
    assert p.layers == 2 * ATTENTION + ROUTER + 4 * EXPERT + DENSE_MLP
    assert m.bytes_per_weight == 4 and m.weight_bytes == 4 * TOTAL and m.active_weight_bytes == 4 * ACTIVE


def test_every_layer_routed_without_mlp_only_layers():
    p = analyze(_moe_config(mlp_only_layers=[])).model.params
    assert p.moe_layers == 2
    assert p.total == 100 * 16 * 2 + 16 + 2 * (ATTENTION + ROUTER + 4 * EXPERT)
    assert p.active == p.total - 2 * 2 * EXPERT
    # decoder_sparse_step 2: layers 1, 3 route, 0 and 2 dense
    step = analyze(_moe_config(num_hidden_layers=4, mlp_only_layers=[], decoder_sparse_step=2)).model.params
    assert step.moe_layers == 2
    assert step.total == 100 * 16 * 2 + 16 + 4 * ATTENTION + 2 * (ROUTER + 4 * EXPERT) + 2 * DENSE_MLP


def test_qwen3_30b_a3b_total_and_active_match_the_model_card():
    m = analyze("qwen3-30b-a3b").model
    p = m.params
    attention = 2048 * (4096 + 2 * 512) + 4096 * 2048 + 2 * 128 + 2 * 2048
    expert = 3 * 2048 * 768
    outer = 2 * 151936 * 2048 + 2048                            # untied embedding and head, final norm
    assert p.total == outer + 48 * (attention + 128 * 2048 + 128 * expert)
    assert p.active == outer + 48 * (attention + 128 * 2048 + 8 * expert)
    assert abs(p.total - 30.5e9) / 30.5e9 < 0.02                # "30.5B in total
    assert abs(p.active - 3.3e9) / 3.3e9 < 0.02                 #  and 3.3B activated"
    assert round(p.total / 1e9, 2) == 30.53 and round(p.active / 1e9, 2) == 3.35
    # the card's non-embedding 29.9B: embedding and head left out
    assert round((p.total - p.embedding - p.lm_head) / 1e9, 1) == 29.9


def test_decode_bound_reads_the_active_weights():
    a = analyze(_moe_config(), hardware=_hardware(), context=10, batch_sizes=(1, 2, 64))
    one, two, many = a.decode
    assert one.flops == 2 * ACTIVE and one.bytes == 4 * ACTIVE + KV * 10       # not 4 x TOTAL
    assert one.time_s == pytest.approx(one.bytes / 1e11) and one.tokens_per_s == pytest.approx(1 / one.time_s)
    # two tokens take 4 (1 - (1 - 2/4)^2) = 3 distinct experts, expected
    assert two.flops == 2 * 2 * ACTIVE and two.bytes == 4 * (TOTAL - 4 * EXPERT + 3 * EXPERT) + 2 * KV * 10
    # a large batch reads every expert
    assert many.bytes == pytest.approx(4 * TOTAL + 64 * KV * 10)


def test_qwen3_30b_a3b_decode_at_batch_1_streams_a_ninth_of_the_weights():
    a = analyze("qwen3-30b-a3b", dtype="q4_k", context=1024, batch_sizes=(1, 8, 512))
    m, one = a.model, a.decode[0]
    weights = one.bytes - m.kv.bytes_at(1024)
    assert weights == pytest.approx(m.params.active * 20 / 32) == pytest.approx(m.active_weight_bytes)
    assert weights < 0.12 * m.weight_bytes                      # 2.1 GB of 19.1 GB
    assert one.time_s == pytest.approx(one.bytes / a.hardware.bandwidth)
    # 8 sequences: 128 (1 - (1 - 8/128)^8) = 51.3 experts per layer of 128
    experts = 128 * (1 - (1 - 8 / 128) ** 8)
    assert m.params.experts_read(8) == pytest.approx(experts) and 51 < experts < 52
    read = m.params.total - m.params.experts + 48 * experts * 3 * 2048 * 768
    assert a.decode[1].bytes - 8 * m.kv.bytes_at(1024) == pytest.approx(read * 20 / 32)
    assert a.decode[2].bytes - 512 * m.kv.bytes_at(1024) == pytest.approx(m.weight_bytes)
    assert [p.flops for p in a.decode] == [2 * m.params.active * b for b in (1, 8, 512)]


def test_prefill_flops_from_the_active_parameters():
    a = analyze(_moe_config(), hardware=_hardware(), prompt_lengths=(1, 1000))
    short, long = a.prefill
    assert short.flops == 2 * ACTIVE and long.flops == 2 * ACTIVE * 1000
    assert short.bytes == 4 * ACTIVE + KV and long.bytes == pytest.approx(4 * TOTAL + KV * 1000)


def test_memory_plan_holds_every_expert():
    budget = 4 * TOTAL + KV * 100 + 1                           # room for 100 tokens beside all of it
    mem = analyze(_moe_config(), hardware=_hardware(budget), context=100).memory
    assert mem.weight_bytes == 4 * TOTAL and mem.kv_budget == budget - 4 * TOTAL
    assert mem.max_tokens == 100 and mem.fits
    # Qwen3-30B-A3B in bf16: 6.7 GB a token reads, 61 GB resident, more than a 24 GB card holds
    big = analyze("qwen3-30b-a3b", hardware=_hardware(24 * 10**9))
    assert big.model.active_weight_bytes < 24e9 < big.memory.weight_bytes == 2 * big.model.params.total
    assert big.memory.kv_budget < 0 and not big.memory.fits and big.memory.max_tokens == 0
    h100 = analyze("qwen3-30b-a3b").memory
    assert h100.kv_budget == 80e9 - 2 * 30_532_122_624 and h100.max_tokens == int(h100.kv_budget // 98_304)


def test_moe_crossovers_are_the_first_compute_bound_sizes():
    for hardware in ("h100", "this"):
        a = analyze("qwen3-30b-a3b", hardware=hardware, context=256)
        c, m, k = a.crossover, a.model, a.model.kv.bytes_per_token
        s = c.prefill_min_prompt_len
        assert routed_intensity(m, k, s) >= c.ridge > routed_intensity(m, k, s - 1)
        assert c.prefill_intensity_limit == 2 * m.params.active / k
        kv = m.kv.bytes_at(256)
        if c.decode_min_batch is None:
            assert 2 * m.params.active / kv <= c.ridge
        else:
            b = c.decode_min_batch
            assert routed_intensity(m, kv, b) >= c.ridge > (routed_intensity(m, kv, b - 1) if b > 1 else 0)
    # the point's own intensity is the one the crossover searches
    a = analyze("qwen3-30b-a3b", prompt_lengths=(100,), batch_sizes=(3,), context=256)
    assert a.prefill[0].intensity == pytest.approx(routed_intensity(a.model, a.model.kv.bytes_per_token, 100))
    assert a.decode[0].intensity == pytest.approx(routed_intensity(a.model, a.model.kv.bytes_at(256), 3))
    assert analyze("qwen3-30b-a3b", hardware="this", context=256).crossover.decode_min_batch is not None


def test_a_given_n_scales_the_active_count():
    m = analyze(_moe_config(), num_params=2 * TOTAL).model
    assert m.num_params == 2 * TOTAL and m.active_params == 2 * ACTIVE
    assert m.weight_bytes_read(1) == pytest.approx(4 * 2 * ACTIVE)


def test_dense_models_have_n_active():
    m = analyze("qwen2.5-7b").model
    assert not m.is_moe and m.params.active == m.params.total and m.active_params == m.num_params
    assert m.weight_bytes_read(1) == m.weight_bytes_read(512) == m.weight_bytes == m.active_weight_bytes
    assert "active" not in format_report(analyze("qwen2.5-7b"))


def test_report_and_json_show_both_counts(capsys):
    assert main(["analyze", "qwen3-30b-a3b", "--dtype", "q4_k"]) == 0
    out = capsys.readouterr().out
    assert "parameters: 30.53B total, 3.35B active per token (8 of 128 experts)" in out
    assert "weights 19.08 GB resident, 2.096 GB read per token at batch 1" in out
    assert "intensity 2N'B/(W(B)+kSB)" in out and "weights read" in out and "(every expert)" in out
    assert len(out.splitlines()) < 40
    data = json.loads(to_json(analyze("qwen3-30b-a3b")))
    assert data["model"]["params"]["active"] == 3_353_032_704
    assert data["model"]["active_params"] == 3_353_032_704 and data["model"]["params"]["num_experts"] == 128


# --- GGUF: the MoE keys read from the metadata ----------------------------------------------------


def _gguf(path, arch: str, dense_layer: bool, **extra):
    """A tiny file: hidden 8, vocabulary 8, 2 query heads and 1 KV head of 4; 4 experts of 16 in
    layer 0, layer 1 dense (MLP 12) where dense_layer else routed too."""
    gguf = pytest.importorskip("gguf")
    writer = gguf.GGUFWriter(str(path), arch)
    for name, value in {"block_count": 2, "context_length": 64, "embedding_length": 8, "feed_forward_length": 12,
                        "attention.head_count": 2, "attention.head_count_kv": 1, "attention.key_length": 4,
                        "attention.value_length": 4, "expert_count": 4, "expert_used_count": 2,
                        "expert_feed_forward_length": 16, **extra}.items():
        writer.add_uint32(f"{arch}.{name}", value)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    tensors = {"token_embd.weight": (8, 8), "output_norm.weight": (8,), "output.weight": (8, 8)}
    for i in range(2):
        tensors |= {f"blk.{i}.{n}": s for n, s in {
            "attn_norm.weight": (8,), "attn_q.weight": (8, 8), "attn_k.weight": (4, 8), "attn_v.weight": (4, 8),
            "attn_output.weight": (8, 8), "ffn_norm.weight": (8,)}.items()}
        if arch == "qwen3moe":
            tensors |= {f"blk.{i}.attn_q_norm.weight": (4,), f"blk.{i}.attn_k_norm.weight": (4,)}
        if i == 1 and dense_layer:
            tensors |= {f"blk.1.ffn_{n}.weight": s for n, s in
                        {"gate": (12, 8), "up": (12, 8), "down": (8, 12)}.items()}
        else:
            tensors |= {f"blk.{i}.ffn_{n}.weight": s for n, s in {
                "gate_inp": (4, 8), "gate_exps": (4, 16, 8), "up_exps": (4, 16, 8), "down_exps": (4, 8, 16)}.items()}
    for name, shape in tensors.items():
        writer.add_tensor(name, np.zeros(shape, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, sum(int(np.prod(s)) for s in tensors.values())


def test_gguf_moe_is_read_from_metadata(tmp_path):
    path, stored = _gguf(tmp_path / "qwen3moe.gguf", "qwen3moe", dense_layer=True)
    m = analyze(str(path)).model
    p = m.params
    assert m.architecture == "Qwen3MoeForCausalLM" and p.total == stored
    assert (p.num_experts, p.experts_per_tok, p.moe_layers, p.expert) == (4, 2, 1, 3 * 8 * 16)
    assert p.active == stored - 2 * 3 * 8 * 16 and m.weight_format == "fp32"


def test_gguf_llama_with_experts_is_mixtral(tmp_path):
    path, stored = _gguf(tmp_path / "mixtral.gguf", "llama", dense_layer=False)
    m = analyze(str(path)).model
    p = m.params
    assert m.architecture == "MixtralForCausalLM" and p.total == stored
    assert (p.num_experts, p.experts_per_tok, p.moe_layers) == (4, 2, 2)
    assert p.active == stored - 2 * 2 * 3 * 8 * 16
