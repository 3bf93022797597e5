"""benchmarks/step_breakdown.py on a tiny model: every part of a decode step is timed, the parts
add up to the step, and --compare-unfused really switches the engine between the decode stack, the
Python layers and the PyTorch ops."""
import importlib.util
import json
import shutil
import sys
from pathlib import Path

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "step_breakdown.py"
_spec = importlib.util.spec_from_file_location("benchmarks_step_breakdown", _PATH)
step_breakdown = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(step_breakdown)


def test_breakdown_parts_add_up_and_both_op_sets_run(tiny_model_dir, monkeypatch, capsys):
    from twostep.layers.norm import RMSNorm, add_rms_norm_native

    calls = {"native": 0}

    def counting(*args):
        calls["native"] += 1
        return add_rms_norm_native(*args)

    monkeypatch.setitem(RMSNorm.native_ops, "add_rms_norm", counting)
    monkeypatch.setattr(sys, "argv", ["step_breakdown.py", "--model", str(tiny_model_dir("llama")),
                                      "--tokens", "6", "--reps", "2", "--compare-unfused", "--json"])
    step_breakdown.main()
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    # the default dtype's linears fuse (so the stack runs) wherever the kernels build: bf16 is the
    # default only with AVX512-BF16 (its matrix-vector kernel), float32 everywhere else
    stack = ["stack"] if shutil.which("g++") else []
    assert [r["ops"] for r in rows] == [*stack, "layers", "torch ops"]
    for r in rows:
        parts = sum(r[k] for k in ("weights", "attention", "other ops", "logits", "inputs", "engine"))
        # medians of each part against the median step, over 12 steps of a tiny model: a part
        # counted twice or lost moves the sum far more than the timing noise (once 1.05x was flaky)
        assert 0 < parts <= r["step"] * 1.25 and parts >= 0.75 * r["step"]
        assert r["weights"] > 0 and r["attention"] > 0 and r["inputs"] > 0 and r["engine"] > 0 and r["tok_s"] > 0
    assert calls["native"] > 0           # the "torch ops" runs went through the PyTorch ops


def test_gemv_bound_measures_the_rate_around_each_rep(tiny_model_dir, monkeypatch, capsys):
    from twostep.layers.dispatch import streamed_weight_bytes

    rates = iter([10.0, 20.0, 40.0])                        # GB/s, as if measured before, between, after
    monkeypatch.setattr(step_breakdown, "gemv_bandwidth", lambda: next(rates))
    monkeypatch.setattr(sys, "argv", ["step_breakdown.py", "--model", str(tiny_model_dir("llama")),
                                      "--tokens", "6", "--reps", "2", "--gemv-bound", "--json"])
    step_breakdown.main()
    row = json.loads(capsys.readouterr().out.splitlines()[0])
    assert row["gemv_GBs"] == [15.0, 30.0]                  # one rate per rep, each the mean around it
    assert len(row["gemv_bound_share"]) == 2 and all(x > 0 for x in row["gemv_bound_share"])
    assert row["stream_MB"] > 0
