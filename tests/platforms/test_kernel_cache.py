"""A warm start loads the kernels straight from torch's extension cache: a fresh process gets every
module this machine built without importing torch.utils.cpp_extension (~0.15 s) or rebuilding."""
from __future__ import annotations

import json
import subprocess
import sys

from twostep import kernels

PROBE = """
import json, sys, time
from twostep import kernels
start = time.perf_counter()
names = ["elementwise", "paged_attention", "quant_linear", "quant_linear_portable"]
loaded = {n: getattr(kernels, n)() is not None for n in names}
print(json.dumps({"loaded": loaded, "seconds": time.perf_counter() - start,
                  "cpp_extension": "torch.utils.cpp_extension" in sys.modules}))
"""


def test_a_fresh_process_imports_the_cached_builds():
    built = {n: getattr(kernels, n)() is not None
             for n in ("elementwise", "paged_attention", "quant_linear", "quant_linear_portable")}
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, timeout=300)
    probe = json.loads(out.stdout.strip().splitlines()[-1])
    assert probe["loaded"] == built
    if any(built.values()):
        assert not probe["cpp_extension"], "a cached kernel went through torch's build tooling"
        assert probe["seconds"] < 2.0, probe



def test_a_lock_left_by_a_killed_build_is_removed(tmp_path, monkeypatch):
    """torch waits for ever while a build folder holds a lock: an old one (a killed build) goes, a
    fresh one (a build under way in another process) stays."""
    import os
    import time

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    for name, age, kept in (("old_build", kernels.STALE_LOCK_SECONDS + 60, False), ("running_build", 5, True)):
        lock = tmp_path / name / "lock"
        lock.parent.mkdir()
        lock.touch()
        os.utime(lock, (time.time() - age, time.time() - age))
        kernels._clear_stale_lock(name)
        assert lock.exists() == kept


def test_the_tests_variants_follow_the_cpus_flags(monkeypatch):
    """The builds `twostep build-kernels --test-variants` adds: the portable one everywhere, the
    AVX2-only and AVX-VNNI ones where the native build has other paths, the other dot width with
    AVX512-VNNI; never one this CPU could not run."""
    cases = {"avx2 fma": ["quant_linear_portable"],
             "avx2 fma avx_vnni": ["quant_linear_portable", "quant_linear_avx2"],
             "avx2 avx512f avx512bw avx512vl avx512_vnni": ["quant_linear_portable", "quant_linear_avx2",
                                                            "quant_linear_other_dot"],
             "avx2 avx_vnni avx512f avx512bw avx512vl avx512_vnni": ["quant_linear_portable", "quant_linear_avx2",
                                                                     "quant_linear_avx_vnni", "quant_linear_other_dot"]}
    for flags, want in cases.items():
        monkeypatch.setattr(kernels, "cpu_flags", lambda flags=flags: frozenset(flags.split()))
        assert list(kernels.test_variants()) == want


def test_build_all_builds_the_engines_kernels_in_parallel_processes():
    built = kernels.build_all()
    assert list(built) == list(kernels.ENGINE_KERNELS)
    assert built == {n: getattr(kernels, n)() is not None for n in kernels.ENGINE_KERNELS}
