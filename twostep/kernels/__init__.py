"""C++ kernels, compiled on first use with torch's extension tooling (g++ and ninja; the build is
cached under ~/.cache/torch_extensions). Where they cannot be built, callers fall back to PyTorch.
A build logs a line when it starts and one with its time when it ends (35-50 s each on two cores,
~2 minutes for quant_linear.cpp); `twostep build-kernels` (run by scripts/setup.sh) builds them all
ahead of the first run, as many at a time as there are cores.

Each build targets the CPU it runs on (-march=native), and its cache entry is named after that
CPU's feature flags (and a hash of the source, the flags and torch's version): a home folder shared
by machines of different kinds (an AVX-512 Zen 4 EPYC, an AVX2-only EPYC, a Xeon with AMX) never runs
code built for another's instructions. A build already in the cache is imported directly, without
torch's build tooling (a warm start's kernels load in ~5 ms, not ~0.2 s)."""
from __future__ import annotations

import functools
import hashlib
import logging
import platform
import time
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


def _load(name: str, source: str, cflags: tuple[str, ...] = ()):
    """Build (or reuse the cached build of) one kernel; None when it cannot be built here. A compiler
    without OpenMP gets a second, single-threaded try."""
    path = str(Path(__file__).with_name(source))
    error = None
    import torch

    # the name carries the CPU's flags and a hash of the source, the flags and torch's version: a
    # build is found by name alone, and a changed kernel (or torch) gets a new one (so the log below
    # knows when a build is coming)
    digest = hashlib.sha1(Path(path).read_bytes() + " ".join((*_CFLAGS, *cflags, torch.__version__)).encode())
    name = f"{name}_{cpu_tag()}_{digest.hexdigest()[:8]}"
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
            module = load(name + suffix, [path], extra_cflags=[*_CFLAGS, *flags, *cflags], verbose=False)
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


# what the engine runs on this CPU, the longest build first (a pool of builds finishes soonest so)
ENGINE_KERNELS = ("quant_linear", "paged_attention", "elementwise", "decode_step", "linear_bf16")


def test_variants() -> tuple[str, ...]:
    """The builds the tests check besides the engine's, on this CPU: the portable one everywhere,
    and the other instruction sets' paths that this CPU can run (tests/quantization)."""
    flags = cpu_flags()
    names = ["quant_linear_portable"]
    if {"avx512_vnni", "avx512vl"} <= flags or "avx_vnni" in flags:
        names.append("quant_linear_avx2")
    if {"avx_vnni", "avx512f"} <= flags:
        names.append("quant_linear_avx_vnni")
    if {"avx512_vnni", "avx512bw"} <= flags:
        names.append("quant_linear_other_dot")
    return tuple(names)


def build_all(with_test_variants: bool = False) -> dict[str, bool]:
    """Build (or find built) every kernel this CPU runs, and the tests' variants if asked, as many
    at a time as this process has cores (each build is one compiler process); name -> usable."""
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
    return globals()[name]() is not None


@functools.lru_cache(maxsize=None)
def paged_attention():
    """The paged decode-attention extension module, or None when it cannot be built here."""
    return _load("twostep_paged_attention", "paged_attention.cpp")


@functools.lru_cache(maxsize=None)
def linear_bf16():
    """The matrix-vector extension module for bf16 weights, or None where it cannot be built. Its
    bf16 inputs need AVX512-BF16 (has_bf16_dot()), its float32 inputs AVX2 or plain C++
    (has_float32_path()): the build targets the machine it runs on."""
    return _load("twostep_linear_bf16", "linear_bf16.cpp")


@functools.lru_cache(maxsize=None)
def elementwise():
    """RMSNorm and rotary embedding as one call each, or None when it cannot be built here.
    -ffp-contract=off: no fused multiply-add, so products and sums round as torch's ops do (and
    signed zeros kept)."""
    return _load("twostep_elementwise", "elementwise.cpp", ("-ffp-contract=off", "-fsigned-zeros"))


def wide_dot_flags() -> tuple[str, ...]:
    """-DTWOSTEP_WIDE_DOT where the small-row int8 product's 512-bit steps were measured faster than
    its 256-bit ones: an AMD Zen 5 or later, whose cores run 512-bit vectors at full width
    (quant_linear.cpp, kWideDot; measured on an EPYC, model 2). A Zen 4 runs them as two halves, and
    Intel's AVX-512 cores are not measured: both keep the 256-bit steps. Zen 5 laptop parts, said to
    split 512-bit vectors as Zen 4 does, take the 512-bit steps too (not measured: the same sums
    either way)."""
    return ("-DTWOSTEP_WIDE_DOT",) if zen5_or_later() else ()


def prefetch_flags() -> tuple[str, ...]:
    """How far ahead the quantized products ask for their weights (quant_linear.cpp,
    kPrefetchAhead): 4 KB on a Zen 5 or later, whose faster memory it keeps busier (the whole
    Qwen-shape decode step 1.05-1.06x the 2 KB where memory ran fast, 1.00x where slow); 2 KB, what
    a Zen 4 measured best, elsewhere. The same sums either way."""
    return ("-DTWOSTEP_PREFETCH_AHEAD=4096",) if zen5_or_later() else ()


# float sums in the order the source writes them: the int8 product's paths for 1, 8 and more rows
# add the same terms in the same order, and must get the same bits (a decode row's logits do not
# depend on its batch), which a compiler free to reassociate (-fassociative-math) does not keep
_IN_ORDER = ("-fno-associative-math",)


@functools.lru_cache(maxsize=None)
def quant_linear():
    """Matrix-vector products and row dequantisation on twostep's packed quantized layout
    (AVX-VNNI / AVX512-VNNI / AVX2, else plain C++), or None when it cannot be built here."""
    return _load("twostep_quant_linear", "quant_linear.cpp", (*_IN_ORDER, *wide_dot_flags(), *prefetch_flags()))


@functools.lru_cache(maxsize=None)
def quant_linear_portable():
    """The same kernel built without its SIMD paths: the fallback for CPUs without AVX2, built
    everywhere by the tests so that path is checked on every machine."""
    return _load("twostep_quant_linear_portable", "quant_linear.cpp", ("-DTWOSTEP_FORCE_SCALAR", *_IN_ORDER))


@functools.lru_cache(maxsize=None)
def quant_linear_avx2():
    """The same kernel built for AVX2 alone (no AVX-512, no VNNI), in its own op namespace: the
    int8 product's AVX2 paths (vpmaddubsw, their own activation layout), which the native build of a
    CPU with VNNI does not compile, built by the tests on such CPUs so those paths are checked there
    too (on an AVX2-only CPU the native build is this one)."""
    return _load("twostep_quant_linear_avx2", "quant_linear.cpp",
                 ("-mno-avx512f", "-mno-avxvnni", "-DTWOSTEP_VARIANT=twostep_avx2", *_IN_ORDER))


@functools.lru_cache(maxsize=None)
def quant_linear_avx_vnni():
    """The same kernel built for AVX2 with AVX-VNNI (256-bit vpdpbusd / vpdpwssd) and no AVX-512,
    in its own op namespace: what the native build is on the CPUs with AVX-VNNI but no AVX-512
    (Intel's client cores since Alder Lake), built by the tests on CPUs that have both (a Zen 5, a
    Sapphire Rapids) so those paths are checked there too."""
    return _load("twostep_quant_linear_avx_vnni", "quant_linear.cpp",
                 ("-mno-avx512f", "-DTWOSTEP_VARIANT=twostep_avx_vnni", *_IN_ORDER))


@functools.lru_cache(maxsize=None)
def quant_linear_other_dot():
    """The same kernel with the other step width of the small-row int8 product (TWOSTEP_WIDE_DOT
    toggled against the native build), in its own op namespace: built by the tests on AVX512-VNNI
    CPUs, so the 256 and 512-bit steps are both checked there (elsewhere it is the native build)."""
    toggled = () if wide_dot_flags() else ("-DTWOSTEP_WIDE_DOT",)
    return _load("twostep_quant_linear_other_dot", "quant_linear.cpp",
                 (*toggled, *prefetch_flags(), "-DTWOSTEP_VARIANT=twostep_other_dot", *_IN_ORDER))


@functools.lru_cache(maxsize=None)
def decode_step():
    """A decode step's decoder layers in one call, composed of the other kernels' registered ops
    (models/fused_decode.py), or None when it cannot be built here. Load the kernels it calls first:
    it finds their ops in torch's dispatcher when a stack is built."""
    return _load("twostep_decode_step", "decode_step.cpp")
