"""The layers are a contract (pyproject.toml, import-linter), kept by the code and written down in
docs/architecture.md as the same table."""
from __future__ import annotations

import re
import subprocess
import sys
import tomllib

import pytest

from conftest import ROOT


def contract_layers() -> list[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    (layers,) = [c for c in config["contracts"] if c["type"] == "layers"]
    return layers["layers"]


def documented_layers() -> list[str]:
    """The second column of the layer table in docs/architecture.md, in order, rows with the
    same modules merged ("a \\| b" is one layer of siblings)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    table = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| ") and "`twostep." in line]
    return [" | ".join(re.findall(r"`(twostep[.\w]*)`", row.split(" | ")[1])) for row in rows]


def test_the_architecture_doc_states_exactly_the_contract():
    assert documented_layers() == contract_layers()


def test_lint_imports_keeps_every_contract():
    tool = ROOT / ".venv" / "bin" / "lint-imports"
    if not tool.is_file():
        tool = type(ROOT)(sys.executable).parent / "lint-imports"
    if not tool.is_file():
        pytest.skip("import-linter is not installed (pip install -r requirements-test.txt)")
    run = subprocess.run([str(tool)], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "0 broken" in run.stdout


def test_streamed_weight_bytes_counts_what_a_batch1_step_reads(tiny_model_dir):
    """Each Linear's weight once, in the form its 1-row product reads (bf16: the row-major copy
    beside oneDNN's packed one is not counted twice), the lm_head included, the embedding not."""
    from twostep import EngineConfig, LLMEngine
    from twostep.layers.dispatch import streamed_weight_bytes, weight_bytes
    from twostep.layers.linear import Linear

    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir("llama")), dtype="bfloat16", kv_cache_memory="16MiB"))
    linears = [m for m in engine.model.modules() if isinstance(m, Linear)]
    assert streamed_weight_bytes(engine.model) == sum(2 * m.in_features * m.out_features for m in linears)
    assert streamed_weight_bytes(engine.model) < weight_bytes(engine.model)
