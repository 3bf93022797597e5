"""Bytes per stored number: the b of the weights and the dtype bytes of the KV cache."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class NumberFormat:
    name: str
    bytes: float                        # per weight (or per cached K/V value)
    aliases: tuple[str, ...] = ()


WEIGHT_FORMATS = (
    NumberFormat("fp32", 4.0, ("float32",)),
    NumberFormat("bf16", 2.0, ("bfloat16",)),
    NumberFormat("fp16", 2.0, ("float16",)),
    NumberFormat("fp8", 1.0, ("float8", "fp8_e4m3", "fp8_e5m2")),
    NumberFormat("int8", 1.0),
    # llama.cpp's block formats add an fp16 scale to every 32 weights: Q8_0 stores a block in 34
    # bytes, Q4_0 in 18, so their b is a little over 1 and 0.5.
    NumberFormat("q8_0", 34 / 32),
    NumberFormat("q4_0", 18 / 32),
    NumberFormat("q4_1", 20 / 32),
    NumberFormat("q5_0", 22 / 32),
    NumberFormat("q5_1", 24 / 32),
    # K-quants as twostep holds them (one float16 scale, and min, per group: quantization/packed.py);
    # in the file Q4_K is 4.5 bits, Q5_K 5.5, Q6_K 6.5625
    NumberFormat("q4_k", 20 / 32),
    NumberFormat("q5_k", 24 / 32),
    NumberFormat("q6_k", 14 / 16),
    NumberFormat("int4", 0.5),
    # --quantization int4: 4-bit codes with a float16 scale and min per 32 weights
    NumberFormat("int4_g32", 20 / 32, ("twostep-int4",)),
)

# K and V are stored per value, never in blocks with shared scales, in the formats engines offer.
KV_FORMATS = tuple(f for f in WEIGHT_FORMATS if f.name in ("fp32", "bf16", "fp16", "fp8", "int8"))


def find_format(name: str, formats: tuple[NumberFormat, ...] = WEIGHT_FORMATS) -> NumberFormat:
    key = name.lower()
    for fmt in formats:
        if key == fmt.name or key in fmt.aliases:
            return fmt
    raise ValueError(f"unknown number format {name!r}: choose one of {', '.join(format_names(formats))}")


def format_names(formats: tuple[NumberFormat, ...] = WEIGHT_FORMATS) -> list[str]:
    return [f.name for f in formats]


def default_kv_format(weights: NumberFormat) -> NumberFormat:
    """Engines keep the KV cache in the type they compute in: the weights' own when they are fp32,
    bf16 or fp16; bf16 for 8- and 4-bit weights, which are widened to compute."""
    name = weights.name if weights.name in ("fp32", "bf16", "fp16") else "bf16"
    return find_format(name, KV_FORMATS)
