"""`twostep analyze` of hybrid models (Qwen3.5, Qwen3-Next): K/V in the attention layers only, a
linear-attention state of constant size per sequence beside them, in the memory plan (weights +
N x state + N x context x k), in decode's bytes (the state read and written each token) and the
delta rule's FLOPs in place of attention's."""
from __future__ import annotations

import json

import pytest

from twostep.analysis import Hardware, analyze, format_report, plan_memory, to_json
from twostep.analysis.model_presets import find_model_preset
from twostep.analysis.model_stats import DELTA_RULE_FLOPS
from twostep.analysis.roofline import decode_point, prefill_point, routed_intensity
from twostep.models.registry import config_from_hf

# Qwen3.5-0.8B: 24 layers, every fourth full attention (2 KV heads x 256); 18 Gated DeltaNet layers
# of 16 key and 16 value heads x 128, a convolution of width 4 over q, k and v
KV_0_8B = 2 * 6 * 2 * 256 * 2                                  # K and V, 6 layers, bf16
CONV_DIM_0_8B = 2 * 16 * 128 + 16 * 128                         # 6144
STATE_0_8B = 18 * (3 * CONV_DIM_0_8B * 2 + 16 * 128 * 128 * 4)  # conv state bf16, recurrent fp32
DELTA_0_8B = 18 * 16 * DELTA_RULE_FLOPS * 128 * 128


def _hardware(memory: int = 10**12) -> Hardware:
    return Hardware("test", "test", 1e15, 1e12, memory, "made up for a test")


def test_qwen3_5_0_8b_kv_counts_the_attention_layers_only():
    m = analyze("qwen3.5-0.8b").model
    assert m.kv.bytes_per_token == KV_0_8B == 12_288
    assert (m.kv.layers, m.num_layers, m.is_hybrid) == (6, 24, True)
    assert m.kv.bytes_at(8192) == 8192 * KV_0_8B
    # fp8 K/V: its 2-byte scale per token and KV head, in the attention layers too
    assert analyze("qwen3.5-0.8b", kv_dtype="fp8").model.kv.bytes_per_token == 2 * 6 * 2 * (256 + 2)


def test_qwen3_5_0_8b_state_per_sequence():
    m = analyze("qwen3.5-0.8b").model
    st = m.state
    assert st.bytes_per_sequence == STATE_0_8B == 19_537_920
    assert (st.layers, st.conv_dim, st.conv_bytes, st.recurrent_bytes) == (18, 6144, 3 * 6144 * 2, 16 * 128 * 128 * 4)
    cfg = config_from_hf(find_model_preset("qwen3.5-0.8b").hf_config())
    assert st.bytes_per_sequence == cfg.state_bytes(2)
    assert m.sequence_bytes(1000) == STATE_0_8B + 1000 * KV_0_8B
    # the convolution state in the type the engine computes in: fp32 weights widen it, 4-bit ones
    # compute in bf16 (the recurrent state is fp32 either way)
    assert analyze("qwen3.5-0.8b", dtype="fp32").model.state.bytes_per_sequence == \
        18 * (3 * 6144 * 4 + 16 * 128 * 128 * 4)
    assert analyze("qwen3.5-0.8b", dtype="int4").model.state.bytes_per_sequence == STATE_0_8B


def test_dense_model_of_the_same_width_keeps_far_more_kv_and_no_state():
    dense, hybrid = analyze("qwen3-0.6b").model, analyze("qwen3.5-0.8b").model
    assert dense.kv.bytes_per_token == 2 * 28 * 8 * 128 * 2 == 114_688
    assert dense.kv.layers == dense.num_layers == 28
    assert not dense.is_hybrid and dense.state.bytes_per_sequence == 0
    assert dense.kv.bytes_per_token / hybrid.kv.bytes_per_token == pytest.approx(9.33, abs=0.01)
    # the hybrid's state costs what 1,590 tokens of its K/V do, or 170 of the dense model's
    assert hybrid.state.bytes_per_sequence // hybrid.kv.bytes_per_token == 1590
    assert hybrid.state.bytes_per_sequence // dense.kv.bytes_per_token == 170


def test_memory_for_n_sequences_is_weights_states_and_kv():
    m = analyze("qwen3.5-0.8b").model
    budget = 4 * 10**9
    plan = plan_memory(m, budget, context=8192, concurrency=16)
    assert plan.kv_bytes == 16 * 8192 * KV_0_8B and plan.state_bytes == 16 * STATE_0_8B
    left = budget - m.weight_bytes
    assert plan.max_concurrency == int(left // (STATE_0_8B + 8192 * KV_0_8B))
    assert plan.max_tokens == int((left - 16 * STATE_0_8B) // KV_0_8B)
    assert plan.max_context == int((left / 16 - STATE_0_8B) // KV_0_8B)
    # one more sequence costs a state and its context's K/V; one more token per sequence, N x k
    more = plan_memory(m, budget, context=8192, concurrency=17)
    assert more.kv_bytes + more.state_bytes - plan.kv_bytes - plan.state_bytes == STATE_0_8B + 8192 * KV_0_8B
    longer = plan_memory(m, budget, context=8193, concurrency=16)
    assert longer.kv_bytes - plan.kv_bytes == 16 * KV_0_8B and longer.state_bytes == plan.state_bytes
    # fits exactly up to max_concurrency sequences, states included
    n = plan.max_concurrency
    assert plan_memory(m, budget, 8192, n).fits and not plan_memory(m, budget, 8192, n + 1).fits
    # states alone past the budget leave no room for K/V
    crowded = plan_memory(m, budget, 8192, int(left // STATE_0_8B) + 1)
    assert (crowded.max_tokens, crowded.max_context, crowded.fits) == (0, 0, False)


def test_decode_bytes_read_the_state_and_write_it_back_each_token():
    m, hw = analyze("qwen3.5-0.8b").model, _hardware()
    for batch in (1, 8):
        short, long = decode_point(m, hw, 256, batch), decode_point(m, hw, 8192, batch)
        for p in (short, long):
            assert p.bytes == m.weight_bytes + batch * (p.tokens * KV_0_8B + 2 * STATE_0_8B)
            assert p.state_bytes == batch * 2 * STATE_0_8B
            assert p.flops == batch * (2 * m.params.total + DELTA_0_8B)
        assert long.bytes - short.bytes == batch * (8192 - 256) * KV_0_8B     # the state's part is flat
    # a dense model has no state: the formula it always had
    dense = analyze("qwen3-0.6b").model
    p = decode_point(dense, hw, 256, 1)
    assert p.state_bytes == 0 and p.bytes == dense.weight_bytes + 256 * dense.kv.bytes_per_token
    assert p.flops == 2 * dense.params.total


def test_prefill_flops_count_the_delta_rule_not_an_attention_term():
    m, hw = analyze("qwen3.5-0.8b").model, _hardware()
    assert m.state.flops_per_token == DELTA_0_8B == 18 * 16 * 7 * 128 * 128
    assert m.flops_per_token == 2 * m.params.total + DELTA_0_8B
    p = prefill_point(m, hw, 1024)
    assert p.flops == 1024 * m.flops_per_token                            # linear in S
    assert p.bytes == m.weight_bytes + 1024 * KV_0_8B + 2 * STATE_0_8B     # the state once per prompt


def test_crossovers_include_the_state():
    a = analyze("qwen3.5-0.8b", hardware=_hardware(), context=8192)
    m, c = a.model, a.crossover
    assert c.decode_intensity_limit == pytest.approx(m.flops_per_token / (8192 * KV_0_8B + 2 * STATE_0_8B))
    assert c.prefill_intensity_limit == pytest.approx(m.flops_per_token / KV_0_8B)
    s = c.prefill_min_prompt_len
    fixed = 2 * STATE_0_8B
    assert routed_intensity(m, KV_0_8B, s, fixed) >= c.ridge > routed_intensity(m, KV_0_8B, s - 1, fixed)
    assert prefill_point(m, a.hardware, s).bound == "compute"
    assert prefill_point(m, a.hardware, s - 1).bound == "memory"


@pytest.mark.parametrize("key, layers, experts, routed, total, active", [
    ("qwen3.5-35b-a3b", 40, 256, 8, 34_660_610_688, 3_454_988_928),
    ("qwen3-next-80b-a3b", 48, 512, 10, 79_674_391_296, 3_874_929_408),
])
def test_hybrid_moe_active_against_total(key, layers, experts, routed, total, active):
    m = analyze(key).model
    p = m.params
    expert = 3 * 2048 * 512
    assert (p.num_experts, p.experts_per_tok, p.moe_layers, p.expert) == (experts, routed, layers, expert)
    assert (p.total, p.active) == (total, active)
    assert p.total - p.active == layers * (experts - routed) * expert
    assert m.active_weight_bytes == 2 * active
    assert m.is_hybrid and m.kv.layers == layers // 4


def test_hybrid_moe_state_and_kv():
    m = analyze("qwen3.5-35b-a3b").model
    assert m.kv.bytes_per_token == 2 * 10 * 2 * 256 * 2 == 20_480
    assert m.state.bytes_per_sequence == 30 * (3 * (2 * 16 * 128 + 32 * 128) * 2 + 32 * 128 * 128 * 4)
    nxt = analyze("qwen3-next-80b-a3b").model
    assert nxt.kv.bytes_per_token == 2 * 12 * 2 * 256 * 2 == 24_576
    assert nxt.state.bytes_per_sequence == 36 * (3 * 8192 * 2 + 32 * 128 * 128 * 4)


def test_report_says_it_in_words():
    text = format_report(analyze("qwen3.5-0.8b", hardware=_hardware(), context=8192, concurrency=4))
    assert "K/V for 6 of 24 layers (the attention ones): k = 12,288 bytes/token" in text
    assert "linear-attention state: 18.63 MiB per sequence, constant in the context" in text
    assert "s = 19,537,920 bytes" in text
    assert "intensity FS/(Nb+kS+2s)" in text and "intensity FB/(Nb+(kS+2s)B)" in text
    assert "decode, batch 1, at context 256 against 8,192" in text
    state_row = next(line for line in text.splitlines() if line.strip().startswith("state read+written"))
    assert state_row.split()[-2:] == state_row.split()[-4:-2] == ["39.08", "MB"]   # flat in the context
    assert "linear-attention state for 4 sequence(s): 78.15 MB" in text
    # a dense model's report is as it was
    dense = format_report(analyze("qwen3-0.6b"))
    assert "k = 114,688 bytes/token = 2 x 28 layers" in dense
    assert "linear-attention" not in dense and "against" not in dense


def test_json_carries_the_state():
    data = json.loads(to_json(analyze("qwen3.5-0.8b")))
    assert data["model"]["state"]["bytes_per_sequence"] == STATE_0_8B
    assert data["model"]["kv"]["layers"] == 6
    assert data["memory"]["state_bytes"] == STATE_0_8B
    assert data["decode"][0]["state_bytes"] == 2 * STATE_0_8B
