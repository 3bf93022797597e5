"""benchmarks/structured_outputs.py on the default model, one short rep: both sides decode the same
number of tokens, the constrained output is the schema's array, and the clocks see the mask."""
import importlib.util
import json
import sys
from pathlib import Path

import pytest

from conftest import smollm_path

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "structured_outputs.py"
_spec = importlib.util.spec_from_file_location("benchmarks_structured_outputs", _PATH)
bench = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


@pytest.mark.slow
def test_benchmark_measures_both_sides_and_the_mask(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["structured_outputs.py", "--model", str(smollm_path()), "--batches", "2",
                                      "--reps", "1", "--json"])
    bench.main()
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    (row,) = result["decode"]
    assert row["batch"] == 2 and row["output_tokens"] > 100
    assert row["tpot_ms_constrained"] > 0 and row["tpot_ms_free"] > 0
    assert 0 < row["mask_ms_per_step"] < row["tpot_ms_constrained"]
    c = result["compile"]
    assert c["schemas"] == 20 and 0 < c["cached_ms_median"] < c["compile_ms_median"]
    from twostep.structured_output.grammar import Grammar
    assert Grammar.bitmask.__name__ == "bitmask"   # the clock put the originals back
