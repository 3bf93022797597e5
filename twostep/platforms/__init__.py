"""Platform dispatch: every piece of device- or CPU-feature knowledge lives under this package
(cpu today, cuda later), chosen once at load, so generic layers and the engine carry none."""
from __future__ import annotations

import torch

from twostep.config import DTYPES
from twostep.config.engine import EngineConfig
from twostep.platforms.cpu import CpuPlatform
from twostep.platforms.interface import Platform

__all__ = ["Platform", "CpuPlatform", "get_platform", "resolve_device", "resolve_dtype"]


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def get_platform(device: torch.device, config: EngineConfig | None = None) -> Platform:
    """The platform for device, with the engine's options for it (config's cpu_* fields on CPU)."""
    if device.type == "cpu":
        return CpuPlatform(device, config)
    return Platform(device)


def resolve_dtype(name: str, platform: Platform) -> torch.dtype:
    """auto: what the platform computes fastest (bf16 where native, see CpuPlatform)."""
    return platform.default_dtype() if name == "auto" else DTYPES[name]
