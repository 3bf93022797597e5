"""benchmarks/prefill_formats.py on tiny models: every file prefilled in every rep, the medians
printed against the first file's."""
import importlib.util
import sys
from pathlib import Path

_DIR = Path(__file__).resolve().parents[2] / "benchmarks"


def test_every_file_against_the_first(tiny_model_dir, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(_DIR))                  # it imports bench_phases beside it
    spec = importlib.util.spec_from_file_location("benchmarks_prefill_formats", _DIR / "prefill_formats.py")
    prefill_formats = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prefill_formats)
    files = [str(tiny_model_dir("llama")), str(tiny_model_dir("qwen2"))]
    monkeypatch.setattr(sys, "argv", ["prefill_formats.py", *files, "--prompt-len", "12", "--reps", "3",
                                      "--dtype", "float32"])
    prefill_formats.main()
    out = capsys.readouterr().out.splitlines()
    assert sum(line.startswith("rep ") for line in out) == 3
    rows = [line.split(" | ") for line in out if line.startswith("| /")]
    assert [r[0].removeprefix("| ") for r in rows] == files
    assert rows[0][2] == "1.00x |" and all(float(r[1]) > 0 for r in rows)
