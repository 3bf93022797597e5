"""C++ kernels (sources in csrc/, docs/kernels.md), compiled on first use with torch's extension
tooling (g++ and ninja, a module's sources in parallel; the build is cached under
~/.cache/torch_extensions). Where they cannot be built, callers fall back to PyTorch. A build logs a
line when it starts and one with its time when it ends; `twostep build-kernels` (run by
scripts/setup.sh) builds them all ahead of the first run, as many at a time as there are cores.
KERNELS below declares each module: its sources, its flags, and for the tests' variants the CPUs
that build them.

Each build targets the CPU it runs on (-march=native), and its cache entry is named after that
CPU's feature flags (and a hash of the sources, the flags and torch's version): a home folder shared
by machines of different kinds (an AVX-512 Zen 4 EPYC, an AVX2-only EPYC, a Xeon with AMX) never runs
code built for another's instructions. A build already in the cache is imported directly, without
torch's build tooling (a warm start's kernels load in ~5 ms, not ~0.2 s)."""
from __future__ import annotations

import functools
import hashlib
import logging
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from twostep.kernels.cpu_features import cpu_flags, zen5_or_later

logger = logging.getLogger(__name__)

# Vectorise the float reductions without -ffast-math's finite-math assumption (scores use -inf).
_CFLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros",
           "-fno-trapping-math"]
# at::parallel_for is OpenMP in torch's headers: without this flag a kernel runs on one thread.
_OPENMP = "-fopenmp"


@functools.lru_cache(maxsize=None)
def cpu_tag() -> str:
    """A short name for this CPU's instruction-set features (the flags line of /proc/cpuinfo)."""
    flags = " ".join(sorted(cpu_flags())) or platform.processor()
    return hashlib.sha1(f"{platform.machine()} {flags}".encode()).hexdigest()[:8]


SOURCES = Path(__file__).with_name("csrc")


def _digest(sources: tuple[str, ...], cflags: tuple[str, ...], torch_version: str) -> str:
    """A hash of what a build depends on: its sources, the headers beside them and the shared ones
    (csrc/*.h), its flags, torch's version."""
    headers = {h for s in sources for h in (SOURCES / s).parent.glob("*.h")} | set(SOURCES.glob("*.h"))
    digest = hashlib.sha1()
    for path in sorted({*(SOURCES / s for s in sources), *headers}):
        digest.update(path.read_bytes())
    digest.update(" ".join((*_CFLAGS, *cflags, torch_version)).encode())
    return digest.hexdigest()[:8]


def _load(name: str, sources: tuple[str, ...], cflags: tuple[str, ...] = ()):
    """Build (or reuse the cached build of) one kernel; None when it cannot be built here. A compiler
    without OpenMP gets a second, single-threaded try."""
    paths = [str(SOURCES / s) for s in sources]
    source = name.removeprefix("twostep_")
    error = None
    import torch

    # the name carries the CPU's flags and a hash of the sources, the flags and torch's version: a
    # build is found by name alone, and a changed kernel (or torch) gets a new one (so the log below
    # knows when a build is coming)
    name = f"{name}_{cpu_tag()}_{_digest(sources, cflags, torch.__version__)}"
    variants = (("", [_OPENMP]), ("_serial", []))
    for suffix, _ in variants:
        module = _import_built(name + suffix)
        if module is not None:
            return module
    for suffix, flags in variants:
        try:
            from torch.utils.cpp_extension import load

            _clear_stale_lock(name + suffix)
            fresh = not _is_built(name + suffix)
            if fresh:
                logger.info("compiling the C++ kernel %s for this CPU (once; up to a few minutes) ...", source)
            start = time.monotonic()
            module = load(name + suffix, paths, extra_cflags=[*_CFLAGS, *flags, *cflags], verbose=False)
            if fresh:
                logger.info("compiled %s in %.0f s", source, time.monotonic() - start)
            return module
        except Exception as e:  # noqa: BLE001 - no compiler, no ninja, a failed build: fall back
            error = e
    logger.warning("C++ kernel %s unavailable (%s: %s); using PyTorch instead", source,
                   type(error).__name__, str(error).splitlines()[0] if str(error) else "")
    return None


def _import_built(name: str):
    """The module of a finished build of `name` in torch's extension cache, imported directly: the
    warm path, without torch.utils.cpp_extension (importing it costs ~0.15 s, and its load() then
    checks the build). None where there is no such build, or the folder is not where torch would
    put it (then load() finds or makes the build)."""
    import importlib.util
    import os
    import sys

    import torch
    import torch._appdirs

    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        if torch.version.cuda is not None or torch.version.hip is not None:
            return None                      # torch names the folder after the accelerator
        python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
        root = os.path.join(os.path.realpath(torch._appdirs.user_cache_dir(appname="torch_extensions")),
                            f"{python}_cpu")
    folder = Path(root) / name
    library = folder / f"{name}.so"
    if not library.is_file() or (folder / "lock").exists():   # absent, or a build under way
        return None
    try:
        spec = importlib.util.spec_from_file_location(name, library)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    except Exception as e:  # noqa: BLE001 - a broken build: load() rebuilds it
        logger.debug("cached kernel %s not importable (%s); rebuilding", library, e)
        return None


# a build takes up to ~3 minutes on two cores; a lock this old was left by a build that was killed
STALE_LOCK_SECONDS = 15 * 60


def _clear_stale_lock(name: str) -> None:
    """torch's build waits, silently and for ever, while its folder holds a lock file; a build
    killed mid-way (Ctrl-C, a timeout) leaves one behind. Remove a lock older than any build."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        lock = Path(_get_build_directory(name, verbose=False)) / "lock"
        age = time.time() - lock.stat().st_mtime
    except Exception:  # noqa: BLE001 - no lock (the usual case), or the private helper moved
        return
    if age > STALE_LOCK_SECONDS:
        logger.warning("removing %s, left %.0f minutes ago by a kernel build that did not finish", lock, age / 60)
        lock.unlink(missing_ok=True)


def _is_built(name: str) -> bool:
    """Whether a build of this module is in torch's extension cache (torch still checks it is current)."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        return (Path(_get_build_directory(name, verbose=False)) / f"{name}.so").is_file()
    except Exception:  # noqa: BLE001 - a private helper: when it moves, just log every build
        return False


@dataclass(frozen=True)
class Kernel:
    """One C++ extension module: its sources under csrc/ (compiled in parallel, as ninja runs them),
    the flags it adds to _CFLAGS (a function: some depend on this CPU), and, for a variant only the
    tests build, on which CPUs (by their /proc/cpuinfo flags) it is worth building."""

    module: str
    sources: tuple[str, ...]
    flags: Callable[[], tuple[str, ...]] = tuple
    test_on: Callable[[set[str]], bool] | None = None


def wide_dot_flags() -> tuple[str, ...]:
    """-DTWOSTEP_WIDE_DOT where the small-row int8 product's 512-bit steps are the faster ones: an
    AMD Zen 5 or later, whose cores run 512-bit vectors at full width (csrc/quant/gemv_int8.cpp). A
    Zen 4 runs them as two halves, and Intel's AVX-512 cores are not measured: both keep the 256-bit
    steps. The same sums either way."""
    return ("-DTWOSTEP_WIDE_DOT",) if zen5_or_later() else ()


def prefetch_flags() -> tuple[str, ...]:
    """How far ahead the quantized products ask for their weights (csrc/quant/codes.h,
    kPrefetchAhead): 4 KB on a Zen 5 or later, whose faster memory it keeps busier; 2 KB elsewhere.
    The same sums either way."""
    return ("-DTWOSTEP_PREFETCH_AHEAD=4096",) if zen5_or_later() else ()


# float sums in the order the source writes them: the int8 product's paths for 1, 8 and more rows
# add the same terms in the same order, and must get the same bits (a decode row's logits do not
# depend on its batch), which a compiler free to reassociate (-fassociative-math) does not keep.
# Hidden symbols: the library's variants load side by side in one process.
_QUANT_FLAGS = ("-fno-associative-math", "-fvisibility=hidden")
QUANT_SOURCES = tuple(f"quant/{unit}.cpp" for unit in (
    "gemv_int8", "gemm_int8", "gemv_panels", "gemv_rows", "gemm_bf16", "gemm_f32", "activations",
    "dequantize", "pack", "experts", "ops", "register"))   # the longest compiles first


def _other_dot_flags() -> tuple[str, ...]:
    return (*(() if wide_dot_flags() else ("-DTWOSTEP_WIDE_DOT",)), *prefetch_flags(),
            "-DTWOSTEP_VARIANT=twostep_other_dot", *_QUANT_FLAGS)


KERNELS: dict[str, Kernel] = {
    # what the engine runs on this CPU, the longest build first (a pool of builds finishes soonest so)
    "quant_linear": Kernel("twostep_quant_linear", QUANT_SOURCES,
                           lambda: (*_QUANT_FLAGS, *wide_dot_flags(), *prefetch_flags())),
    "paged_attention": Kernel("twostep_paged_attention", ("paged_attention.cpp",)),
    # -ffp-contract=off: no fused multiply-add, so products and sums round as torch's ops do
    "elementwise": Kernel("twostep_elementwise", ("elementwise.cpp",),
                          lambda: ("-ffp-contract=off", "-fsigned-zeros")),
    "decode_step": Kernel("twostep_decode_step", ("decode_step.cpp",)),
    "linear_bf16": Kernel("twostep_linear_bf16", ("linear_bf16.cpp",)),
    "gated_delta": Kernel("twostep_gated_delta", ("gated_delta.cpp",)),
    # the tests' builds of the quantized products: the portable one (no SIMD) everywhere, and the
    # other instruction sets' paths that this CPU can run, each in its own op namespace
    "quant_linear_portable": Kernel("twostep_quant_linear_portable", QUANT_SOURCES,
                                    lambda: ("-DTWOSTEP_FORCE_SCALAR", *_QUANT_FLAGS), lambda flags: True),
    "quant_linear_avx2": Kernel("twostep_quant_linear_avx2", QUANT_SOURCES,
                                lambda: ("-mno-avx512f", "-mno-avxvnni", "-DTWOSTEP_VARIANT=twostep_avx2", *_QUANT_FLAGS),
                                lambda flags: {"avx512_vnni", "avx512vl"} <= flags or "avx_vnni" in flags),
    "quant_linear_avx_vnni": Kernel("twostep_quant_linear_avx_vnni", QUANT_SOURCES,
                                    lambda: ("-mno-avx512f", "-DTWOSTEP_VARIANT=twostep_avx_vnni", *_QUANT_FLAGS),
                                    lambda flags: {"avx_vnni", "avx512f"} <= flags),
    "quant_linear_other_dot": Kernel("twostep_quant_linear_other_dot", QUANT_SOURCES, _other_dot_flags,
                                     lambda flags: {"avx512_vnni", "avx512bw"} <= flags),
}
ENGINE_KERNELS = tuple(name for name, kernel in KERNELS.items() if kernel.test_on is None)


def test_variants() -> tuple[str, ...]:
    """The builds the tests check besides the engine's, on this CPU (tests/quantization)."""
    flags = cpu_flags()
    return tuple(name for name, kernel in KERNELS.items() if kernel.test_on is not None and kernel.test_on(flags))


def build_all(with_test_variants: bool = False) -> dict[str, bool]:
    """Build (or find built) every kernel this CPU runs, and the tests' variants if asked, as many
    at a time as this process has cores (each build's sources compile in parallel too); name ->
    usable."""
    import multiprocessing
    import os
    from concurrent.futures import ProcessPoolExecutor

    names = [*ENGINE_KERNELS, *(test_variants() if with_test_variants else ())]
    jobs = min(len(names), len(os.sched_getaffinity(0)))
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"),
                             initializer=_log_like, initargs=(logging.getLogger("twostep").getEffectiveLevel(),)) as pool:
        return dict(zip(names, pool.map(_builds, names)))


def _log_like(level: int) -> None:
    """A build process logs its progress as the parent does."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("twostep").setLevel(level)


def _builds(name: str) -> bool:
    return built(name) is not None


@functools.lru_cache(maxsize=None)
def built(name: str):
    """The extension module of KERNELS[name], built for this CPU (or found built); None where it
    cannot be built here."""
    kernel = KERNELS[name]
    return _load(kernel.module, kernel.sources, kernel.flags())


def paged_attention():
    """The paged decode-attention extension module, or None when it cannot be built here."""
    return built("paged_attention")


def linear_bf16():
    """The matrix-vector extension module for bf16 weights, or None where it cannot be built. Its
    bf16 inputs need AVX512-BF16 (has_bf16_dot()), its float32 inputs AVX2 or plain C++
    (has_float32_path())."""
    return built("linear_bf16")


def elementwise():
    """RMSNorm, rotary embedding, SiLU-and-multiply, the K/V cache write and argmax as one call
    each, or None when it cannot be built here."""
    return built("elementwise")


def quant_linear():
    """Products and row dequantisation on twostep's packed quantized layouts (AVX-VNNI /
    AVX512-VNNI / AVX2, else plain C++), or None when it cannot be built here."""
    return built("quant_linear")


def quant_linear_portable():
    """The quantized products built without their SIMD paths: the fallback for CPUs without AVX2,
    built everywhere by the tests so that path is checked on every machine."""
    return built("quant_linear_portable")


def quant_linear_avx2():
    """The quantized products for AVX2 alone (no AVX-512, no VNNI): the int8 product's vpmaddubsw
    paths, which a CPU with VNNI does not compile natively, checked there by the tests."""
    return built("quant_linear_avx2")


def quant_linear_avx_vnni():
    """The quantized products for AVX2 with AVX-VNNI and no AVX-512 (Intel's client cores since
    Alder Lake), checked by the tests on CPUs that have both."""
    return built("quant_linear_avx_vnni")


def quant_linear_other_dot():
    """The quantized products with the other step width of the small-row int8 product
    (TWOSTEP_WIDE_DOT toggled), checked by the tests on AVX512-VNNI CPUs."""
    return built("quant_linear_other_dot")


def gated_delta():
    """A Gated DeltaNet layer's decode step (conv, delta rule, gated RMSNorm) as one call, or None
    when it cannot be built here."""
    return built("gated_delta")


def decode_step():
    """A decode step's decoder layers in one call, composed of the other kernels' registered ops
    (models/fused_decode.py), or None when it cannot be built here. Load the kernels it calls first:
    it finds their ops in torch's dispatcher when a stack is built."""
    return built("decode_step")
