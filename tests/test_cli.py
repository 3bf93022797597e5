"""`twostep generate` streams text and ends with the phase summary; bad input exits cleanly."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from twostep.cli import main


def test_generate_streams_and_summarises(tiny_model_dir, capsys):
    folder = tiny_model_dir("llama")
    rc = main(["generate", "--model", str(folder), "--dtype", "float32", "--kv-cache-memory", "4MiB",
               "--max-tokens", "6", "--ignore-eos", "Once upon a time"])
    captured = capsys.readouterr()
    assert rc == 0
    summary = captured.err.strip().splitlines()[-1]
    for part in ("[length]", "generated 6 tok", "TTFT", "TPOT", "KV blocks"):
        assert part in summary
    assert captured.out.endswith("\n")


def test_generate_chat_and_bad_values(tiny_model_dir, capsys):
    folder = str(tiny_model_dir("qwen3"))
    assert main(["generate", "--model", folder, "--chat", "--max-tokens", "3", "hi"]) == 0
    assert main(["generate", "--model", folder, "--temperature", "-1", "hi"]) == 2
    assert "temperature" in capsys.readouterr().err
    assert main(["generate", "--model", "/no/such/model.gguf", "hi"]) == 2


def test_env_names_the_cpu_the_default_dtype_and_the_kernel_paths(capsys):
    from twostep.kernels.cpu_features import cpu_flags

    assert main(["env"]) == 0
    out = capsys.readouterr().out
    native = bool({"avx512_bf16", "amx_bf16"} & cpu_flags())
    assert f"default dtype: {'bfloat16' if native else 'float32'}, as this CPU" in out
    assert "instruction sets:" in out and "quantized products:" in out and "one-call decode stack:" in out
    if "avx2" in cpu_flags():
        assert "float32 inputs through the AVX2 path" in out


def test_installed_command_runs(tiny_model_dir):
    exe = Path(sys.executable).parent / "twostep"
    if not exe.exists():
        import pytest
        pytest.skip("twostep is not installed as a command in this environment")
    proc = subprocess.run([str(exe), "generate", "--model", str(tiny_model_dir("mistral")),
                           "--max-tokens", "4", "--ignore-eos", "hello"],
                          capture_output=True, text=True, timeout=120, env={**os.environ})
    assert proc.returncode == 0, proc.stderr
    assert "generated 4 tok" in proc.stderr


def test_folder_without_tokenizer_is_a_clear_error(tmp_path, tiny_model_dir, capsys):
    import shutil

    folder = tmp_path / "notok"
    shutil.copytree(tiny_model_dir("llama"), folder)
    (folder / "tokenizer.json").unlink()
    assert main(["generate", "--model", str(folder), "hi"]) == 2
    assert "tokenizer.json" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_help_renders(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    assert "--max-num-batched-tokens" in capsys.readouterr().out


def test_serve_takes_the_model_positionally_as_vllm_does(capsys):
    from twostep.cli import main

    assert main(["serve", "a-model", "--model", "another"]) == 2
    assert "the model is given twice" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("twostep ")


@pytest.mark.parametrize("collecting", [True, False])
def test_import_freezes_its_objects_and_leaves_the_collector_as_it_was(collecting):
    """`import twostep` pauses the cycle collector while torch imports and freezes what it imported
    (~0.2 s of a warm start-up): the collector is on or off afterwards as it was before, the
    imported objects are out of its sight, and garbage made after the import is still collected."""
    code = f"""
import gc, sys, weakref
{'gc.enable()' if collecting else 'gc.disable()'}
import twostep
assert gc.isenabled() is {collecting}, gc.isenabled()
assert "torch" in sys.modules and gc.get_freeze_count() > 100_000, gc.get_freeze_count()
class Node:
    pass
a, b = Node(), Node()
a.other, b.other = b, a
alive = weakref.ref(a)
del a, b
gc.collect()
assert alive() is None, "a cycle made after the import was not collected"
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("argv,expected", [([], "decode"), (["--cpu-int8-activations"], "all"),
                                           (["--cpu-int8-activations", "off"], "off"),
                                           (["--cpu-int8-activations", "decode"], "decode"),
                                           (["--no-cpu-int8-activations"], "off")])
def test_int8_activations_flag(argv, expected):
    """decode by default, the flag alone all (what it meant when it was a switch), or as named;
    the Python API also takes True / False for all / off and refuses anything else."""
    import argparse

    from twostep import EngineConfig
    from twostep.cli import add_engine_args, engine_config_from

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_config_from(p.parse_args(argv)).cpu_int8_activations == expected
    assert EngineConfig(cpu_int8_activations=True).cpu_int8_activations == "all"
    assert EngineConfig(cpu_int8_activations=False).cpu_int8_activations == "off"
    with pytest.raises(ValueError, match="off, decode or all"):
        EngineConfig(cpu_int8_activations="sometimes")
