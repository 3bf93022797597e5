"""The default dtype follows what the CPU computes in hardware: bf16 only where its flags name
AVX512-BF16 or AMX-BF16 (oneDNN "supports" bf16 on every AVX-512 CPU by emulating it, several
times slower than float32), else float32; the start-up log says which and why. The flags are faked:
each CPU kind's choice is checked on whatever machine runs the suite."""
from __future__ import annotations

import logging

import pytest
import torch

import twostep.platforms.cpu as cpu_platform
from conftest import cpu_flags as conftest_cpu_flags, run_all
from twostep import EngineConfig, LLMEngine, SamplingParams

ZEN1 = "fpu sse2 avx avx2 fma f16c"
ICE_LAKE = ZEN1 + " avx512f avx512bw avx512vl avx512_vnni avx512_vbmi2"
ZEN4 = ICE_LAKE + " avx512_bf16"
SAPPHIRE_RAPIDS = ZEN4 + " amx_bf16 amx_tile amx_int8"
AMX_ONLY = ZEN1 + " amx_bf16"


def fake_flags(monkeypatch, flags: str) -> None:
    monkeypatch.setattr(cpu_platform, "cpu_flags", lambda: frozenset(flags.split()))


@pytest.mark.parametrize("flags,dtype", [(ZEN1, torch.float32), (ICE_LAKE, torch.float32), ("", torch.float32),
                                         (ZEN4, torch.bfloat16), (SAPPHIRE_RAPIDS, torch.bfloat16),
                                         (AMX_ONLY, torch.bfloat16)],
                         ids=["avx2", "avx512-without-bf16", "no-flags", "avx512-bf16", "amx", "amx-only"])
def test_bf16_by_default_only_where_the_cpu_computes_it(monkeypatch, flags, dtype):
    fake_flags(monkeypatch, flags)
    platform = cpu_platform.CpuPlatform(torch.device("cpu"))
    assert platform.default_dtype() == dtype
    reason = platform.default_dtype_reason()
    if dtype == torch.bfloat16:
        assert "in hardware" in reason and ("avx512_bf16" in reason or "amx_bf16" in reason)
    else:
        assert "no amx_bf16 or avx512_bf16" in reason


def test_the_machines_own_flags_decide():
    """Without faking: this machine's flags, as the test reads /proc/cpuinfo itself."""
    native = bool({"avx512_bf16", "amx_bf16"} & conftest_cpu_flags())
    want = torch.bfloat16 if native else torch.float32
    assert cpu_platform.CpuPlatform(torch.device("cpu")).default_dtype() == want


@pytest.mark.parametrize("flags,dtype", [(ICE_LAKE, "float32"), (ZEN4, "bfloat16")])
def test_the_engine_logs_its_choice(tiny_model_dir, monkeypatch, caplog, flags, dtype):
    fake_flags(monkeypatch, flags)
    with caplog.at_level(logging.INFO, logger="twostep.engine.llm_engine"):
        engine = LLMEngine(EngineConfig(model=str(tiny_model_dir("llama")), kv_cache_memory="2MiB"))
    assert str(engine.dtype) == f"torch.{dtype}"
    assert any(r.getMessage().startswith(f"dtype auto: {dtype}, as this CPU") for r in caplog.records)


def test_bfloat16_stays_available_where_it_is_emulated(tiny_model_dir, monkeypatch):
    """--dtype bfloat16 works on a CPU without bf16 hardware (slowly): the flags do not refuse it."""
    fake_flags(monkeypatch, ICE_LAKE)
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir("llama")), dtype="bfloat16", kv_cache_memory="2MiB"))
    assert engine.dtype == torch.bfloat16
    [out] = run_all(engine, [[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 3
