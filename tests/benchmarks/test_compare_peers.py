"""The pure logic of benchmarks/compare.py: finding llama.cpp, reading its benchmarks' output,
and the decode rate from token timestamps. Samples are real output of the llama.cpp tools built
from the llama-cpp-python 0.3.36 sdist (abridged where marked)."""
import importlib.util
import os
import stat
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "compare.py"
_spec = importlib.util.spec_from_file_location("benchmarks_compare", _PATH)
compare = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)   # dataclasses need it
_spec.loader.exec_module(compare)

LLAMA_BENCH_JSON = """[
  {
    "build_commit": "0c1e570",
    "build_number": 1,
    "cpu_info": "AMD EPYC",
    "model_filename": "/tmp/twostep-qwen-shape/model-bf16.gguf",
    "model_type": "qwen2 1B BF16",
    "n_threads": 2,
    "n_prompt": 32,
    "n_gen": 0,
    "n_depth": 0,
    "test_time": "2026-11-29T12:25:47Z",
    "avg_ns": 109666868,
    "stddev_ns": 0,
    "avg_ts": 291.792777,
    "stddev_ts": 0.000000,
    "samples_ns": [ 109666868 ],
    "samples_ts": [ 291.793 ]
  },
  {
    "n_prompt": 0,
    "n_gen": 8,
    "n_depth": 16,
    "avg_ts": 29.552392,
    "samples_ts": [ 29.552 ]
  }
]
"""

BATCHED_BENCH_OUT = """
llama_batched_bench: n_kv_max = 1024, n_batch = 2048, n_ubatch = 512, flash_attn = -1, is_pp_shared = 0, is_tg_separate = 0, n_gpu_layers = -1, n_threads = 2, n_threads_batch = 2

|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|    16 |      8 |    2 |     48 |    0.113 |   283.40 |    0.358 |    44.75 |    0.470 |   102.03 |
|    16 |      8 |    4 |     96 |    0.180 |   356.46 |    0.419 |    76.37 |    0.599 |   160.39 |

"""


def test_parse_llama_bench_json():
    rows = compare.parse_llama_bench_json(LLAMA_BENCH_JSON)
    assert rows == [{"n_prompt": 32, "n_gen": 0, "n_depth": 0, "tok_s": 291.792777},
                    {"n_prompt": 0, "n_gen": 8, "n_depth": 16, "tok_s": 29.552392}]


def test_parse_batched_bench_table():
    rows = compare.parse_batched_bench(BATCHED_BENCH_OUT)
    assert [(r["B"], r["S_TG t/s"]) for r in rows] == [(2, 44.75), (4, 76.37)]
    assert rows[0]["PP"] == 16 and rows[0]["TG"] == 8 and rows[1]["T_TG s"] == 0.419


def test_parse_batched_bench_no_table():
    assert compare.parse_batched_bench("main: error: failed to load model\n") == []


def test_only_one_row():
    assert compare._only([{"a": 1}]) == {"a": 1}
    with pytest.raises(ValueError, match="expected one result row, got 0"):
        compare._only([])


def test_find_llama_cpp_missing(tmp_path):
    assert compare.find_llama_cpp([str(tmp_path / "nope"), None], search_path=False,
                                  try_import=False) == ("missing", None)


def _fake_binaries(folder: Path, names) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        f = folder / name
        f.write_text("#!/bin/sh\n")
        f.chmod(f.stat().st_mode | stat.S_IXUSR)


def test_find_llama_cpp_needs_both_binaries(tmp_path):
    _fake_binaries(tmp_path / "half", ["llama-bench"])
    _fake_binaries(tmp_path / "full", compare.LLAMA_CPP_BINS)
    dirs = [str(tmp_path / "half"), str(tmp_path / "full")]
    assert compare.find_llama_cpp(dirs, search_path=False, try_import=False) == (
        "bin", str(tmp_path / "full"))


def test_find_llama_cpp_on_path(tmp_path, monkeypatch):
    _fake_binaries(tmp_path / "bin", compare.LLAMA_CPP_BINS)
    monkeypatch.setenv("PATH", str(tmp_path / "bin") + os.pathsep + os.environ.get("PATH", ""))
    assert compare.find_llama_cpp([None], try_import=False) == ("bin", str(tmp_path / "bin"))


def test_default_dirs_put_the_env_var_first(monkeypatch):
    monkeypatch.setenv("LLAMA_CPP_BIN_DIR", "/somewhere")
    assert compare.default_llama_cpp_dirs() == ["/somewhere"]


def test_llama_cpp_peer_reports_how_to_install(monkeypatch):
    monkeypatch.setattr(compare, "find_llama_cpp", lambda *a, **k: ("missing", None))
    engine, status = compare.llama_cpp_peer("/x.gguf", threads=2, n_ctx=256)
    assert engine is None and status.startswith("not installed (") and "llama-bench" in status


def test_decode_rate_counts_tokens_after_every_first_token():
    # two sequences: first tokens at 1.0 and 2.0; from 2.0 to 4.0 come 2 + 2 tokens
    assert compare.decode_rate([[1.0, 1.5, 3.0, 4.0], [2.0, 3.0, 4.0]]) == pytest.approx(2.0)
    # one timestamp list shared by a batch of 4 (HF): 3 steps in 3 s -> 4 tokens/s
    assert compare.decode_rate([[0.0, 1.0, 2.0, 3.0]] * 4) == pytest.approx(4.0)


def test_default_dtype_is_what_the_platform_computes_fastest():
    from twostep.platforms.cpu import has_native_bf16

    assert compare.default_dtype() == ("bfloat16" if has_native_bf16() else "float32")


def test_read_rate_reports_the_batch1_weight_stream_as_a_share_of_the_read(tiny_model_dir, tmp_path, monkeypatch):
    import json

    class FixedRead:                      # a plain read of 8 GB/s before each run and 12 after: 10 around it
        def __init__(self) -> None:
            self.calls = 0

        def measure(self) -> float:
            self.calls += 1
            return 8.0 if self.calls % 2 else 12.0

    class FixedPeer:                      # a peer at 50 tokens/s in every phase
        name = "llama.cpp"

        def measure(self, phase, seed: int) -> float:
            return 50.0

    monkeypatch.setattr(compare, "ReadRate", FixedRead)
    monkeypatch.setattr(compare, "llama_cpp_peer", lambda *a: (FixedPeer(), "a stand-in"))
    monkeypatch.setattr(compare, "VOCAB", 300)          # prompt ids within the tiny vocabulary
    out = tmp_path / "r.json"
    monkeypatch.setattr(sys, "argv", ["compare.py", "--mode", "phases", "--model", str(tiny_model_dir("llama")),
                                      "--peers", "llama.cpp", "--reps", "2", "--prompt-len", "8",
                                      "--decode-prompt-len", "8", "--gen", "4", "--batches", "1", "2", "--read-rate",
                                      "--json", str(out)])
    compare.main()
    result = json.loads(out.read_text())
    assert len(result["b1_stream_shares"]["twostep"]) == 2          # batch 1 only, each rep
    tok_s = result["samples"]["twostep"]["decode b1"]
    want = sorted(t * result["step_MB"] / 1e3 / 10.0 for t in tok_s)
    assert sorted(result["b1_stream_shares"]["twostep"]) == pytest.approx(want)
    assert result["b1_stream_of_read"]["twostep"] > 0
    # the peer's share from its own tokens/s, and the ratio the two would have at the same read rate
    assert result["b1_stream_of_read"]["llama.cpp"] == pytest.approx(50.0 * result["step_MB"] / 1e3 / 10.0)
    assert result["b1_at_same_read_rate"]["twostep/llama.cpp"] == pytest.approx(
        result["b1_stream_of_read"]["twostep"] / result["b1_stream_of_read"]["llama.cpp"])
