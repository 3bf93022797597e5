"""C++ kernels, compiled on first use with torch's extension tooling (g++ and ninja; the build is
cached under ~/.cache/torch_extensions). Where they cannot be built, callers fall back to PyTorch."""
from __future__ import annotations

import functools
import logging
from pathlib import Path

logger = logging.getLogger(__name__)

# Vectorise the float reductions without -ffast-math's finite-math assumption (scores use -inf).
_CFLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros",
           "-fno-trapping-math"]


@functools.lru_cache(maxsize=None)
def paged_attention():
    """The paged decode-attention extension module, or None when it cannot be built here."""
    try:
        from torch.utils.cpp_extension import load

        return load("twostep_paged_attention", [str(Path(__file__).with_name("paged_attention.cpp"))],
                    extra_cflags=_CFLAGS, verbose=False)
    except Exception as e:  # noqa: BLE001 - no compiler, no ninja, a failed build: fall back
        logger.warning("paged attention kernel unavailable (%s: %s); using the PyTorch backend",
                       type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        return None
