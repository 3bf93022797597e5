"""The benchmark machinery: seeded workloads, statistics, and the bench commands end to end."""
from __future__ import annotations

import json

import pytest
from conftest import smollm_path

from twostep.bench import workloads
from twostep.bench.stats import mean, percentile
from twostep.cli import main


def test_workloads_are_seeded_and_within_their_ranges():
    a = workloads.uniform(20, (5, 9), (1, 3), vocab_size=50, seed=3)
    b = workloads.uniform(20, (5, 9), (1, 3), vocab_size=50, seed=3)
    c = workloads.uniform(20, (5, 9), (1, 3), vocab_size=50, seed=4)
    assert a == b and a != c
    assert all(5 <= len(r.prompt_token_ids) <= 9 and 1 <= r.output_len <= 3 for r in a)
    assert all(0 <= t < 50 for r in a for t in r.prompt_token_ids)
    fixed = workloads.fixed(4, 7, 2, vocab_size=50)
    assert [(len(r.prompt_token_ids), r.output_len) for r in fixed] == [(7, 2)] * 4


def test_nano_vllm_workload_scales_down_to_its_first_requests():
    full = workloads.nano_vllm(vocab_size=1000)
    assert len(full) == 256
    assert all(100 <= len(r.prompt_token_ids) <= 1024 and 100 <= r.output_len <= 1024 for r in full)
    assert workloads.nano_vllm(vocab_size=1000, num_prompts=8) == full[:8]


def test_long_and_short_spreads_the_long_prompts_among_the_short():
    w = workloads.long_and_short(8, 16, 32, 2, 300, 4, vocab_size=50, seed=1)
    shape = [(len(r.prompt_token_ids), r.output_len) for r in w]
    assert shape == [(16, 32)] * 4 + [(300, 4)] + [(16, 32)] * 4 + [(300, 4)]
    assert w == workloads.long_and_short(8, 16, 32, 2, 300, 4, vocab_size=50, seed=1)


def test_bad_ranges_are_refused():
    with pytest.raises(ValueError):
        workloads.uniform(1, (0, 5), (1, 2), 10)
    with pytest.raises(ValueError):
        workloads.parse_range("10-20")
    assert workloads.parse_range("100:1024") == (100, 1024)


def test_percentiles_match_numpy():
    import numpy as np

    values = [3.0, 1.0, 4.0, 1.5, 9.0, 2.6, 5.0]
    for q in (0, 25, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert mean([1.0, 2.0, 6.0]) == 3.0


def test_bench_commands_run(tiny_model_dir, capsys, tmp_path):
    folder = str(tiny_model_dir("llama"))
    trace = tmp_path / "bench.json"
    assert main(["bench", "throughput", "--model", folder, "--dataset", "random", "--num-prompts", "6",
                 "--random-input-range", "4:20", "--random-output-range", "2:6", "--json",
                 "--kv-cache-memory", "4MiB", "--trace", str(trace)]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    expected = workloads.uniform(6, (4, 20), (2, 6), 384, 0)
    assert r["num_requests"] == 6
    assert r["output_tokens"] == sum(x.output_len for x in expected)
    assert r["prompt_tokens"] == sum(len(x.prompt_token_ids) for x in expected)
    assert r["output_tokens_per_s"] > 0
    assert any(e.get("cat") == "step" for e in json.loads(trace.read_text())["traceEvents"])
    assert main(["bench", "latency", "--model", folder, "--input-lens", "8,32", "--output-len", "4",
                 "--reps", "1", "--json", "--kv-cache-memory", "4MiB"]) == 0
    captured = capsys.readouterr()
    r = json.loads(captured.out.strip().splitlines()[-1])
    assert "latency runs" in captured.err and "3/3" in captured.err     # the progress bar
    assert [p["input_len"] for p in r["prefill"]] == [8, 32]
    assert r["decode"]["decode_tokens_per_s"] > 0


def test_ceilings_measure_and_bound_a_model():
    from twostep.analysis.ceilings import (Ceilings, format_ceilings, gemv_bandwidth, last_level_cache_bytes,
                                        matmul_flops, model_bounds, read_bandwidth)
    import torch

    assert 1 << 20 <= last_level_cache_bytes() <= 16 << 30    # a cache's size, not a parse error

    assert read_bandwidth(nbytes=1 << 24, reps=3) > 0
    assert matmul_flops(torch.bfloat16, n=256, reps=2) > 0
    assert gemv_bandwidth(rows=512, cols=512, reps=3) > 0
    c = Ceilings(threads=2, read_bandwidth_gbs=50.0, matmul_gflops={"bfloat16": 800.0},
                 gemv_bandwidth_gbs=25.0)
    b = model_bounds(c, num_params=1e8, weight_bytes=2e8, dtype="bfloat16")
    assert b["decode_batch1_tokens_per_s"] == 250.0           # 50 GB/s / 0.2 GB per token
    assert b["decode_batch1_tokens_per_s_at_gemv_rate"] == 125.0
    assert b["prefill_tokens_per_s"] == 4000.0                # 800 GFLOP/s / 2e8 FLOP per token
    assert "decode batch 1" in format_ceilings(c, b, "m")


@pytest.mark.slow
def test_ceilings_command_bounds_a_model(tiny_model_dir, capsys):
    assert main(["bench", "ceilings", "--model", str(tiny_model_dir("llama")), "--json"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["ceilings"]["read_bandwidth_gbs"] > 0 and r["bounds"]["prefill_tokens_per_s"] > 0


@pytest.mark.slow
def test_ceilings_bound_a_quantized_file_by_its_own_bytes(capsys):
    """The engine keeps a quantized GGUF packed, so its batch-1 bound divides the bandwidth by the
    file's bytes per weight, not by bf16's (which would understate it ~3.5x for Q4_1)."""
    from twostep.analysis.analyze import analyze

    path = smollm_path()
    assert main(["bench", "ceilings", "--model", str(path), "--json"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    stats = analyze(str(path), hardware="this").model
    assert stats.bytes_per_weight < 1
    assert r["bounds"]["decode_batch1_tokens_per_s"] == pytest.approx(
        r["ceilings"]["read_bandwidth_gbs"] * 1e9 / stats.weight_bytes)
