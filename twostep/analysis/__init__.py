"""Roofline and memory analysis of a model on a hardware, from its config alone (no weights loaded):
`analyze(...)` returns an `Analysis`; `format_report`, `to_json` and `plot_roofline` present it."""
from twostep.analysis.analyze import DEFAULT_BATCH_SIZES, DEFAULT_PROMPT_LENGTHS, Analysis, analyze
from twostep.analysis.hardware import HARDWARE_PRESETS, Hardware, edit_hardware, find_hardware
from twostep.analysis.memory import MemoryPlan, plan_memory
from twostep.analysis.model_presets import MODEL_PRESETS
from twostep.analysis.model_stats import KVStats, ModelStats, ParamCounts, StateStats, count_params
from twostep.analysis.plot import plot_roofline     # imports matplotlib only when called
from twostep.analysis.report import format_report, to_json
from twostep.analysis.roofline import (Crossover, PhasePoint, decode_intensity, first_compute_bound,
                                       prefill_intensity)


__all__ = ["analyze", "Analysis", "ModelStats", "ParamCounts", "KVStats", "StateStats", "Hardware",
           "PhasePoint", "Crossover", "MemoryPlan", "HARDWARE_PRESETS", "MODEL_PRESETS", "DEFAULT_PROMPT_LENGTHS",
           "DEFAULT_BATCH_SIZES", "find_hardware", "edit_hardware", "count_params", "plan_memory",
           "prefill_intensity", "decode_intensity", "first_compute_bound", "format_report", "to_json",
           "plot_roofline"]
