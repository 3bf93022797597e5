"""Every option declared once (twostep/config/options.py): each EngineConfig field is a flag of
`twostep generate / serve / bench`, each engine flag is a field of EngineConfig or of its
speculative config, and docs/usage.md is the reference the fields make."""
from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from twostep.cli import POOLER_PREFIX, SPECULATIVE_PREFIX, add_engine_args, engine_config_from
from twostep.config import EngineConfig, PoolerConfig, SpeculativeConfig
from twostep.config.options import declared
from twostep.config.reference import usage_markdown

USAGE = Path(__file__).resolve().parents[1] / "docs" / "usage.md"


def engine_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return p


def test_every_flag_is_a_field_and_every_field_a_flag():
    dests = {a.dest for a in engine_parser()._actions if a.dest != "help"}
    engine = {f.name for f in dataclasses.fields(EngineConfig)}
    speculative = {SPECULATIVE_PREFIX + f.name for f in dataclasses.fields(SpeculativeConfig)}
    pooler = {POOLER_PREFIX + f.name for f in dataclasses.fields(PoolerConfig)}
    known = engine | speculative | pooler
    assert dests <= known, f"flags without a config field: {sorted(dests - known)}"
    assert engine <= dests, f"config fields without a flag: {sorted(engine - dests)}"
    assert speculative <= dests and pooler <= dests
    assert all(f.name in {g.name for g, _ in declared(EngineConfig)} for f in dataclasses.fields(EngineConfig))


def test_the_flags_defaults_are_the_configs():
    assert engine_config_from(engine_parser().parse_args([])) == EngineConfig()


@pytest.mark.parametrize("argv,field,value", [
    (["--max-num-seqs", "7"], "max_num_seqs", 7), (["-q", "int4"], "quantization", "int4"),
    (["--no-enable-prefix-caching"], "enable_prefix_caching", False), (["--dtype", "bf16"], "dtype", "bfloat16"),
    (["--distributed-timeout", "9"], "distributed_timeout_s", 9.0), (["--kv-cache-dtype", "fp8"], "kv_cache_dtype", "fp8_e4m3"),
    (["--kv-cache-memory-fraction", "0.5"], "kv_cache_memory_fraction", 0.5), (["-tp", "2"], "tensor_parallel_size", 2),
    (["--num-speculative-tokens", "3", "--speculative-method", "ngram"], "speculative_config",
     SpeculativeConfig("ngram", num_speculative_tokens=3)),
    (["--task", "embed"], "convert", "embed"), (["--runner", "pooling", "--pooling-type", "mean", "--no-normalize"],
                                                "pooler_config", PoolerConfig("MEAN", False)),
    (["--pooler-config", '{"pooling_type": "CLS", "activation": false}', "--pooling-type", "last"], "pooler_config",
     PoolerConfig("LAST", activation=False)),
])
def test_a_flag_sets_its_field(argv, field, value):
    assert getattr(engine_config_from(engine_parser().parse_args(argv)), field) == value


def test_the_option_reference_is_current():
    assert USAGE.read_text() == usage_markdown(), "docs/usage.md is stale: python -m twostep.config > docs/usage.md"
