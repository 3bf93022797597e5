"""What this CPU is and which instructions it has, read once from /proc/cpuinfo: the kernels' build
flags and the platform's choices (the default dtype) come from here, and tests fake these two
functions to check a choice on a CPU kind the machine is not."""
from __future__ import annotations

import functools
import platform


@functools.lru_cache(maxsize=None)
def cpu_info() -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo (vendor_id, cpu family, model, model name,
    flags, ...); empty where there is no such file."""
    try:
        with open("/proc/cpuinfo") as f:
            first = f.read().split("\n\n", 1)[0]
    except OSError:
        return {}
    return {key.strip(): value.strip() for key, _, value in (line.partition(":") for line in first.splitlines())}


@functools.lru_cache(maxsize=None)
def cpu_flags() -> frozenset[str]:
    """The instruction-set flags as Linux names them (x86: "avx2", "avx512_bf16", "amx_bf16";
    Arm: the Features line)."""
    info = cpu_info()
    return frozenset((info.get("flags") or info.get("Features") or "").split())


def cpu_name() -> str:
    """The model name, and vendor, family and model where /proc/cpuinfo gives them."""
    info = cpu_info()
    name = info.get("model name") or platform.processor() or platform.machine()
    if "cpu family" in info:
        name += f" ({info.get('vendor_id', '?')}, family {info['cpu family']}, model {info.get('model', '?')})"
    return name


def zen5_or_later() -> bool:
    """An AMD Zen 5 or later: vendor AuthenticAMD, cpu family 26 and up."""
    info = cpu_info()
    try:
        return info.get("vendor_id") == "AuthenticAMD" and int(info.get("cpu family", "0")) >= 26
    except ValueError:
        return False
