"""One call from a model and a hardware to the whole picture: model figures, both phases' rooflines
at several sizes, where they flip, and the memory plan."""
from __future__ import annotations

from dataclasses import dataclass

from twostep.analysis.hardware import Hardware, find_hardware
from twostep.analysis.memory import MemoryPlan, plan_memory
from twostep.analysis.model_source import load_model_source, source_from_hf_config
from twostep.analysis.model_stats import ModelStats, model_stats
from twostep.analysis.number_formats import KV_FORMATS, default_kv_format, find_format
from twostep.analysis.roofline import Crossover, PhasePoint, crossover, decode_point, prefill_point

# Wide enough to show prefill flip on every preset's ridge (11 to 400 FLOP/byte) and decode stay
# under it; 1024 is the reference text's worked example.
DEFAULT_PROMPT_LENGTHS = (16, 128, 1024, 8192, 32768)
DEFAULT_BATCH_SIZES = (1, 8, 32, 128, 512)


@dataclass(slots=True, frozen=True)
class Analysis:
    model: ModelStats
    hardware: Hardware
    prefill: tuple[PhasePoint, ...]     # one sequence of each prompt length
    decode: tuple[PhasePoint, ...]      # each batch size, every sequence at the same context
    crossover: Crossover
    memory: MemoryPlan


def analyze(model: str | dict, *, hardware: str | Hardware = "h100", dtype: str = "auto",
            kv_dtype: str = "auto", num_params: float | None = None, context: int = 1024,
            concurrency: int = 1, prompt_lengths: tuple[int, ...] = DEFAULT_PROMPT_LENGTHS,
            batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES) -> Analysis:
    """`model`: a preset name, HF folder, config.json or .gguf path, or a HF config dict.
    `dtype` "auto" is the checkpoint's own; `kv_dtype` "auto" follows it (bf16 for 8/4-bit weights).
    `num_params` replaces the N counted from the config. `context` is the tokens per sequence for
    decode and the memory plan; `concurrency` the sequences held at once in the memory plan."""
    _check_positive(context=[context], concurrency=[concurrency], prompt_lengths=prompt_lengths,
                    batch_sizes=batch_sizes)
    source = (source_from_hf_config(model, "config") if isinstance(model, dict)
              else load_model_source(model))
    weights = source.stored_format if dtype == "auto" else find_format(dtype)
    kv = default_kv_format(weights) if kv_dtype == "auto" else find_format(kv_dtype, KV_FORMATS)
    stats = model_stats(source, weights, kv, num_params)
    hw = find_hardware(hardware) if isinstance(hardware, str) else hardware
    return Analysis(
        model=stats, hardware=hw,
        prefill=tuple(prefill_point(stats, hw, s) for s in prompt_lengths),
        decode=tuple(decode_point(stats, hw, context, b) for b in batch_sizes),
        crossover=crossover(stats, hw, context),
        memory=plan_memory(stats, hw.memory, context, concurrency),
    )


def _check_positive(**sizes: tuple[int, ...] | list[int]) -> None:
    for name, values in sizes.items():
        if not values or any(not isinstance(v, int) or v < 1 for v in values):
            raise ValueError(f"{name} must be positive whole numbers, got {list(values)}")
