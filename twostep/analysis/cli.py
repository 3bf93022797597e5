"""`twostep analyze MODEL`: the roofline and memory picture of a model on a hardware, from its
config alone, as a short report, JSON, or a chart."""
from __future__ import annotations

import argparse

from twostep.analysis.analyze import DEFAULT_BATCH_SIZES, DEFAULT_PROMPT_LENGTHS, analyze
from twostep.analysis.hardware import edit_hardware, find_hardware, hardware_names
from twostep.analysis.model_presets import MODEL_PRESETS
from twostep.analysis.number_formats import KV_FORMATS, find_format, format_names
from twostep.analysis.plot import plot_roofline
from twostep.analysis.report import format_report, to_json


def add_analyze_args(p: argparse.ArgumentParser) -> None:
    presets = ", ".join(preset.key for preset in MODEL_PRESETS)
    p.add_argument("model", help=f"preset name ({presets}), HF folder, config.json, .gguf file, "
                                 "or 'default' (the engine's default model)")
    p.add_argument("--hardware", default="h100", choices=[*hardware_names(), "measured"],
                   help="datasheet figures, 'this' for this 2-core machine's notes, or 'measured' to "
                        "measure this machine now with `twostep bench ceilings` (default: h100)")
    p.add_argument("--flops", type=float, default=None,
                   help="peak FLOP/s in TFLOP/s, replacing the preset's (e.g. a measured figure)")
    p.add_argument("--bandwidth", type=float, default=None,
                   help="memory bandwidth in GB/s, replacing the preset's")
    p.add_argument("--memory", default=None, help='memory for weights + KV, e.g. "80GB" or "24GiB"')
    p.add_argument("--dtype", default="auto", type=_format_name, choices=["auto", *format_names()],
                   help="weight format, setting b (default: the checkpoint's own; float32/bfloat16/"
                        "float16 spellings too)")
    p.add_argument("--kv-dtype", default="auto", type=_format_name, choices=["auto", *format_names(KV_FORMATS)],
                   help="KV cache format (default: the weights' float type, bf16 for 8/4-bit weights)")
    p.add_argument("--params", type=float, default=None,
                   help="N to use instead of the count from the config, e.g. 7.615e9")
    p.add_argument("--context", type=int, default=1024,
                   help="tokens per sequence for decode and the memory plan (default: 1024)")
    p.add_argument("--concurrency", type=int, default=1,
                   help="sequences held at once in the memory plan (default: 1)")
    p.add_argument("--prompt-lengths", type=_int_list, default=DEFAULT_PROMPT_LENGTHS,
                   help=f"prefill points, comma-separated (default: {_joined(DEFAULT_PROMPT_LENGTHS)})")
    p.add_argument("--batch-sizes", type=_int_list, default=DEFAULT_BATCH_SIZES,
                   help=f"decode points, comma-separated (default: {_joined(DEFAULT_BATCH_SIZES)})")
    p.add_argument("--plot", default=None, metavar="FILE", help="write a roofline chart (.png or .svg)")
    p.add_argument("--json", action="store_true", help="print JSON instead of the report")
    p.add_argument("--measure", action="store_true",
                   help="also run the engine here (model: a folder or .gguf, or 'default') and print "
                        "measured TTFT/TPOT beside the bounds of --hardware (use 'this')")


def run_analyze(args: argparse.Namespace) -> int:
    hardware = _hardware(args)
    if args.measure:
        return _run_measure(args, hardware)
    result = analyze(_model(args.model), hardware=hardware, dtype=args.dtype, kv_dtype=args.kv_dtype,
                     num_params=args.params, context=args.context, concurrency=args.concurrency,
                     prompt_lengths=args.prompt_lengths, batch_sizes=args.batch_sizes)
    if args.plot:    # first: a bad file name should fail before any output
        plot_roofline(result, args.plot)
    print(to_json(result) if args.json else format_report(result))
    if args.plot and not args.json:     # JSON output stays one parseable document
        print(f"\nroofline chart written to {args.plot}")
    return 0


def _run_measure(args: argparse.Namespace, hardware) -> int:
    import json

    from twostep.analysis.measure import format_measured, measure

    result, points = measure(_model(args.model), hardware)
    if args.json:
        print(json.dumps({"analysis": json.loads(to_json(result)), "measured": [
            {"phase": p.phase, "tokens": p.tokens, "batch": p.batch, "bound_s": p.bound_s,
             "measured_s": p.measured_s, "fraction_of_bound": p.fraction_of_bound} for p in points]}))
    else:
        print(format_report(result))
        print()
        print(format_measured(points))
    return 0


def _model(name: str) -> str:
    """'default' is the engine's packaged default model (SmolLM2-135M-Instruct GGUF)."""
    if name != "default":
        return name
    from twostep.models.loader import default_model_path

    return default_model_path()


def _hardware(args: argparse.Namespace):
    base = _measured_hardware() if args.hardware == "measured" else find_hardware(args.hardware)
    return edit_hardware(
        base,
        peak_flops=None if args.flops is None else args.flops * 1e12,
        bandwidth=None if args.bandwidth is None else args.bandwidth * 1e9,
        memory=None if args.memory is None else _memory_bytes(args.memory))


def _memory_bytes(text: str) -> int:
    from twostep.kv.cache_tensors import parse_bytes

    try:
        return parse_bytes(text)
    except ValueError:
        raise ValueError(f"--memory {text!r} is not a size like '80GB' or '24GiB'") from None


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(","))
    except ValueError:
        message = f"{text!r} is not a list of whole numbers like 1,8,32"
        raise argparse.ArgumentTypeError(message) from None


def _joined(values: tuple[int, ...]) -> str:
    return ",".join(str(v) for v in values)


def _measured_hardware():
    """This machine as measured now: read bandwidth and bf16 matmul FLOP/s from the ceilings
    benchmark, memory from /proc/meminfo."""
    from twostep.analysis.hardware import Hardware
    from twostep.analysis.ceilings import measure_ceilings

    c = measure_ceilings(("bfloat16",))
    with open("/proc/meminfo") as f:
        total = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    return Hardware("measured", f"this machine, measured ({c.threads} threads)",
                    c.matmul_gflops["bfloat16"] * 1e9, c.read_bandwidth_gbs * 1e9, total,
                    "twostep bench ceilings, run now")


def _format_name(text: str) -> str:
    """A format as analyze names it, from any of its spellings (bfloat16 -> bf16, fp8_e4m3 -> fp8)."""
    if text == "auto":
        return text
    try:
        return find_format(text).name
    except ValueError:
        return text          # argparse's choices then name what is accepted
