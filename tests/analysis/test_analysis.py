"""`twostep analyze`: parameter and KV counting, the reference text's worked example, crossovers,
the memory planner, the chart and the command line."""
from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest
from conftest import ARCH_CONFIGS, load_hf, stories_path

from twostep.analysis import (MODEL_PRESETS, Hardware, analyze, decode_intensity, first_compute_bound,
                              plot_roofline, prefill_intensity)
from twostep.analysis.plot import DECODE_GID, PREFILL_GID
from twostep.analysis.roofline import intensity
from twostep.cli import main

SVG = "{http://www.w3.org/2000/svg}"


def _config(heads: int, kv_heads: int, layers: int = 2, hidden: int = 256, head_dim: int = 16) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "hidden_size": hidden, "intermediate_size": 512,
            "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
            "head_dim": head_dim, "vocab_size": 1000, "max_position_embeddings": 4096,
            "torch_dtype": "bfloat16"}


def _hardware(memory: int, peak_flops: float = 1e12, bandwidth: float = 1e11) -> Hardware:
    return Hardware("test", "test", peak_flops, bandwidth, memory, "made up for a test")


# --- the model's figures ------------------------------------------------------------------------


def test_qwen2_5_7b_kv_bytes_and_parameter_count():
    m = analyze("qwen2.5-7b").model
    assert m.kv.bytes_per_token == 57_344 == 2 * 28 * 4 * 128 * 2
    assert m.params.total == 7_615_616_512
    assert abs(m.params.total - 7.61e9) / 7.61e9 < 1e-3              # the model card's 7.61B
    assert m.params.total // 10**6 == 7615                            # the text's N = 7.615e9, cut short
    assert round((m.params.total - m.params.embedding - m.params.lm_head) / 1e9, 2) == 6.53  # non-embedding
    assert not m.params.tied and m.params.lm_head == m.params.embedding == 152064 * 3584
    assert m.bytes_per_weight == 2 and m.weight_bytes == 2 * m.params.total


@pytest.mark.parametrize("preset", MODEL_PRESETS, ids=lambda p: p.key)
def test_presets_match_published_parameter_counts(preset):
    total = analyze(preset.key).model.params.total
    assert abs(total - preset.published_params) / preset.published_params < preset.published_tolerance


def test_tied_head_is_counted_once():
    p = analyze("qwen2.5-0.5b").model.params
    assert p.tied and p.total == p.embedding + p.layers + p.final_norm
    assert round(p.total / 1e6) == 494 and round(p.embedding / 1e6) == 136   # PERFORMANCE-NOTES.md


@pytest.mark.parametrize("arch", sorted(ARCH_CONFIGS))
def test_counted_parameters_equal_the_checkpoints(tiny_model_dir, arch):
    """Biases, q/k norms, explicit head_dim, MQA and tied heads, held against transformers."""
    folder = tiny_model_dir(arch)
    expected = sum(p.numel() for p in load_hf(folder).parameters())   # tied weights once
    assert analyze(str(folder)).model.params.total == expected
    assert analyze(str(folder / "config.json")).model.params.total == expected


def test_gguf_is_read_from_metadata_alone():
    import gguf

    path = stories_path()
    m = analyze(str(path)).model
    assert m.params.total == sum(int(t.n_elements) for t in gguf.GGUFReader(path).tensors)
    assert (m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim) == (5, 8, 4, 8)
    assert m.weight_format == "fp32" and m.kv.format == "fp32"     # an all-F32 file


def test_gqa_saving_against_mha():
    kv = analyze(_config(heads=28, kv_heads=4)).model.kv
    assert kv.attention == "GQA" and kv.saving == 7
    assert kv.mha_bytes_per_token == 7 * kv.bytes_per_token
    assert analyze(_config(heads=8, kv_heads=1)).model.kv.attention == "MQA"
    mha = analyze(_config(heads=8, kv_heads=8)).model.kv
    assert mha.attention == "MHA" and mha.saving == 1


def test_dtypes_set_b_and_k():
    m = analyze("qwen2.5-7b", dtype="q4_0", kv_dtype="fp8").model
    # 8-bit KV: one byte per value plus twostep's 2-byte scale per token and KV head
    assert m.bytes_per_weight == 18 / 32 and m.kv.bytes_per_token == 57_344 // 2 + 2 * 28 * 4 * 2
    assert analyze("qwen2.5-7b", kv_dtype="fp8_e4m3").model.kv.bytes_per_token == 57_344 // 2 + 448
    assert analyze("qwen2.5-7b", dtype="fp32").model.kv.bytes_per_token == 2 * 57_344
    assert analyze("qwen2.5-7b", dtype="int8").model.kv.format == "bf16"   # widened to compute
    with pytest.raises(ValueError, match="unknown number format"):
        analyze("qwen2.5-7b", dtype="fp5")


# --- the roofline ---------------------------------------------------------------------------------


def test_reference_worked_example():
    """shared/reference/004: N = 7.615e9 (its rounded N), b = 2, k = 57344, S = 1024."""
    a = analyze("qwen2.5-7b", num_params=7.615e9, prompt_lengths=(1024,), batch_sizes=(1,),
                context=1024)
    assert round(a.prefill[0].intensity, 1) == 1020.1
    assert round(a.decode[0].intensity, 2) == 1.00
    assert round(prefill_intensity(7.615e9, 2, 57344, 1024), 1) == 1020.1
    assert round(decode_intensity(7.615e9, 2, 57344, 1024), 2) == 1.00
    # N counted from the config rounds the same way
    counted = analyze("qwen2.5-7b", prompt_lengths=(1024,), batch_sizes=(1,))
    assert round(counted.prefill[0].intensity, 1) == 1020.1 and round(counted.decode[0].intensity, 2) == 1.00


def test_batched_decode_intensity():
    n, b, k, s = 1e9, 2, 1000, 100
    assert decode_intensity(n, b, k, s, batch=8) == pytest.approx(2 * n * 8 / (n * b + k * s * 8))
    assert decode_intensity(n, b, k, s, batch=1) < 2 / b       # one sequence never passes 2/b


@pytest.mark.parametrize("hardware", ["h100", "h200", "a100", "l4", "rtx4090", "this"])
def test_crossovers_are_the_first_compute_bound_sizes(hardware):
    a = analyze("qwen2.5-7b", hardware=hardware, context=256)
    c, ridge = a.crossover, a.hardware.ridge
    n, b, k = a.model.num_params, a.model.bytes_per_weight, a.model.kv.bytes_per_token
    s = c.prefill_min_prompt_len
    assert prefill_intensity(n, b, k, s) >= ridge > prefill_intensity(n, b, k, s - 1)
    if c.decode_min_batch is None:
        assert 2 * n / (k * 256) <= ridge
    else:
        batch = c.decode_min_batch
        assert decode_intensity(n, b, k, 256, batch) >= ridge > decode_intensity(n, b, k, 256, batch - 1)
    for p in a.prefill:
        assert p.bound == ("compute" if p.tokens >= s else "memory")


def test_crossover_closed_form_and_never():
    # Without KV traffic, prefill crosses where 2S/b reaches the ridge.
    assert first_compute_bound(1e9, 2, 0, ridge=295.2) == 296
    assert first_compute_bound(1e9, 2, 0, ridge=0.5) == 1
    # decode at a long context: intensity is capped at 2N/(kS), under the ridge
    assert first_compute_bound(1e9, 2, c=1e7, ridge=300) is None
    assert intensity(1e9, 2, 1e7, 10**9) < 200


def test_crossover_on_h100_and_this_machine():
    h100 = analyze("qwen2.5-7b").crossover
    assert h100.prefill_min_prompt_len == 296                 # ridge 295.2 ~ 2S/b
    assert h100.decode_min_batch is None                      # 2N/(kS) = 259 < 295 at 1024 tokens
    assert round(h100.decode_intensity_limit, 1) == 259.4
    this = analyze("qwen2.5-0.5b", hardware="this").crossover
    assert this.prefill_min_prompt_len == 12 and this.decode_min_batch == 14


def test_ttft_and_tpot_lower_bounds():
    a = analyze("qwen2.5-7b", prompt_lengths=(16, 4096), batch_sizes=(1, 64))
    hw, m = a.hardware, a.model
    short, long = a.prefill
    assert short.bound == "memory" and short.time_s == pytest.approx(short.bytes / hw.bandwidth)
    assert long.bound == "compute" and long.time_s == pytest.approx(2 * m.num_params * 4096 / hw.peak_flops)
    one, many = a.decode
    assert one.time_s == pytest.approx((m.weight_bytes + 57344 * 1024) / hw.bandwidth)
    assert many.tokens_per_s == pytest.approx(64 / many.time_s)
    assert one.attainable_flops == pytest.approx(one.intensity * hw.bandwidth)


# --- the memory planner ---------------------------------------------------------------------------


def test_memory_plan_arithmetic():
    config = _config(heads=4, kv_heads=2, layers=2, head_dim=16)      # k = 2*2*2*16*2 = 256 B
    weights = 1000 * 4                                                 # N = 1000 in fp32
    budget = weights + 256 * 100 + 10                                  # room for 100 tokens
    a = analyze(config, hardware=_hardware(budget), dtype="fp32", kv_dtype="bf16", num_params=1000,
                context=30, concurrency=4)
    mem = a.memory
    assert a.model.kv.bytes_per_token == 256 and mem.weight_bytes == weights
    assert mem.kv_bytes == 256 * 30 * 4 and not mem.fits
    assert (mem.max_tokens, mem.max_context, mem.max_concurrency) == (100, 25, 3)
    fits = analyze(config, hardware=_hardware(budget), dtype="fp32", kv_dtype="bf16", num_params=1000,
                   context=25, concurrency=4).memory
    assert fits.fits and fits.kv_bytes == 256 * 100


def test_memory_when_the_weights_do_not_fit():
    mem = analyze("qwen2.5-72b", context=131072).memory
    assert mem.kv_bytes == 327_680 * 131_072                           # ~42.9 GB: "tens of GB"
    assert 10e9 < mem.kv_bytes < 100e9
    assert mem.kv_budget < 0 and not mem.fits and mem.max_tokens == mem.max_concurrency == 0


# --- output: chart, JSON, report, CLI -------------------------------------------------------------


def test_plot_png_and_svg(tmp_path):
    pytest.importorskip("matplotlib")
    a = analyze("qwen2.5-7b", prompt_lengths=(16, 256, 4096), batch_sizes=(1, 8, 64, 256))
    png = tmp_path / "roofline.png"
    assert plot_roofline(a, png) == a.prefill + a.decode
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    svg = tmp_path / "roofline.svg"
    plot_roofline(a, svg)
    groups = {g.get("id"): g for g in ET.parse(svg).getroot().iter(f"{SVG}g")}
    assert len(list(groups[PREFILL_GID].iter(f"{SVG}use"))) == 3
    assert len(list(groups[DECODE_GID].iter(f"{SVG}use"))) == 4
    with pytest.raises(ValueError, match="must end in"):
        plot_roofline(a, tmp_path / "roofline.gif")


def test_cli_report_for_a_preset(capsys):
    assert main(["analyze", "qwen2.5-7b"]) == 0
    out = capsys.readouterr().out
    for part in ("k = 57,344 bytes/token", "1,020.1", "GQA", "ridge 295.2", "compute-bound from S >= 296",
                 "TTFT >=", "TPOT >=", "fits"):
        assert part in out
    assert len(out.splitlines()) < 40                               # short


def test_cli_72b_kv_at_128k(capsys):
    assert main(["analyze", "qwen2.5-72b", "--context", "131072"]) == 0
    out = capsys.readouterr().out
    assert "KV cache for 1 x 131,072 tokens: 42.95 GB (40.00 GiB)" in out


def test_cli_json_plot_and_hand_given_hardware(tmp_path, tiny_model_dir, capsys):
    pytest.importorskip("matplotlib")
    chart = tmp_path / "r.svg"
    assert main(["analyze", str(tiny_model_dir("qwen2")), "--json", "--plot", str(chart),
                 "--flops", "2", "--bandwidth", "100", "--memory", "1GiB",
                 "--prompt-lengths", "8,64", "--batch-sizes", "1,4"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["hardware"]["peak_flops"] == 2e12 and data["hardware"]["bandwidth"] == 100e9
    assert data["hardware"]["memory"] == 1 << 30 and data["hardware"]["ridge"] == 20
    assert data["hardware"]["name"] == "custom"
    assert [p["tokens"] for p in data["prefill"]] == [8, 64] and [p["batch"] for p in data["decode"]] == [1, 4]
    assert chart.is_file()


def test_cli_gguf(capsys):
    path = stories_path()
    assert main(["analyze", str(path), "--hardware", "this", "--params", "3e5"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("stories260K: LlamaForCausalLM") and "(given; 2.9280e5 counted)" in out


def test_cli_bad_input_is_a_clear_error(capsys):
    assert main(["analyze", "no-such-model"]) == 2
    assert "preset" in capsys.readouterr().err
    assert main(["analyze", "/no/such/model.gguf"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["analyze", "qwen2.5-7b", "--memory", "lots"]) == 2
    assert "--memory" in capsys.readouterr().err
    assert main(["analyze", "qwen2.5-7b", "--context", "0"]) == 2
    with pytest.raises(SystemExit):
        main(["analyze", "qwen2.5-7b", "--batch-sizes", "1,x"])


def test_cli_help_renders(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["analyze", "--help"])
    assert exit_info.value.code == 0 and "--kv-dtype" in capsys.readouterr().out


def test_measure_sets_the_engine_beside_the_bounds(tiny_model_dir, capsys):
    import json

    from twostep.analysis.hardware import find_hardware
    from twostep.analysis.measure import measure
    from twostep.cli import main

    folder = str(tiny_model_dir("llama"))
    result, points = measure(folder, find_hardware("this"), prompt_lengths=(16, 64), batch_sizes=(1, 4),
                             decode_tokens=4, reps=1, dtype="float32")
    assert [(p.phase, p.tokens, p.batch) for p in points] == [
        ("prefill", 16, 1), ("prefill", 64, 1), ("decode", 18, 1), ("decode", 18, 4)]
    assert result.model.weight_bytes == result.model.params.total * 4     # fp32, as the engine ran
    for p in points:
        assert p.bound_s > 0 and p.measured_s > 0
        assert p.fraction_of_bound == p.bound_s / p.measured_s
    assert main(["analyze", folder, "--measure", "--hardware", "this", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {m["phase"] for m in data["measured"]} == {"prefill", "decode"}


@pytest.mark.slow
def test_measured_hardware(capsys):
    from twostep.cli import main

    assert main(["analyze", "smollm2-135m", "--hardware", "measured", "--json"]) == 0
    import json

    data = json.loads(capsys.readouterr().out)
    assert "measured" in json.dumps(data["hardware"])


def test_sliding_window_layers_hold_their_window(capsys):
    """Gemma 3 1B: 22 of 26 layers attend within 512 tokens, so at 8k a sequence holds
    (4 x 8192 + 22 x 512) tokens' worth of one layer's K/V instead of 26 x 8192."""
    a = analyze("gemma-3-1b", dtype="bf16", kv_dtype="bf16", context=8192, concurrency=1)
    kv = a.model.kv
    per_layer = 2 * 1 * 256 * 2                                         # K and V, 1 KV head of 256, bf16
    assert kv.bytes_per_token == 26 * per_layer
    assert kv.bytes_at(8192) == (4 * 8192 + 22 * 512) * per_layer
    assert kv.bytes_at(300) == 26 * 300 * per_layer                    # within the window: no saving
    assert a.memory.kv_bytes == kv.bytes_at(8192)
    assert main(["analyze", "gemma-3-1b", "--context", "8192"]) == 0
    assert "sliding window 512 in 22 of 26 layers" in capsys.readouterr().out
