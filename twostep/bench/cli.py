"""`twostep bench throughput|latency` arguments and reports."""
from __future__ import annotations

import argparse
import json

from twostep.bench import workloads
from twostep.config.engine import canonical_dtype


def add_bench_args(p: argparse.ArgumentParser, add_run_args) -> None:
    """add_run_args(parser): the flags of a command that runs the engine (twostep.cli)."""
    sub = p.add_subparsers(dest="bench", required=True)
    t = sub.add_parser("throughput", help="offline throughput of a whole workload")
    t.add_argument("--dataset", choices=["fixed", "random", "nano-vllm"], default="fixed",
                   help="fixed lengths, random lengths in ranges, or nano-vllm's shared workload")
    t.add_argument("--num-prompts", type=int, default=None,
                   help="requests (default: 32; nano-vllm: its 256, or its first N)")
    t.add_argument("--input-len", type=int, default=128)
    t.add_argument("--output-len", type=int, default=128)
    t.add_argument("--random-input-range", default="100:1024", help="with --dataset random")
    t.add_argument("--random-output-range", default="100:1024", help="with --dataset random")
    t.add_argument("--workload-seed", type=int, default=0)
    t.add_argument("--json", action="store_true")
    add_run_args(t)
    lat = sub.add_parser("latency", help="batch-1 prefill and decode, measured apart")
    lat.add_argument("--input-lens", default="128,512", help="prompt lengths for prefill")
    lat.add_argument("--output-len", type=int, default=64)
    lat.add_argument("--batch-size", type=int, default=1, help="sequences decoding together")
    lat.add_argument("--reps", type=int, default=3)
    lat.add_argument("--json", action="store_true")
    add_run_args(lat)
    from twostep.bench.serve import add_serve_args

    add_serve_args(sub.add_parser("serve", help="online benchmark of a running OpenAI-compatible server"))
    c = sub.add_parser("ceilings", help="this machine's bandwidth and matmul FLOP/s, and a model's bounds")
    c.add_argument("--model", default=None,
                   help="bound this model too: preset, folder, config.json, .gguf, or 'default'")
    c.add_argument("--dtype", default="bfloat16", type=canonical_dtype, choices=["bfloat16", "float32"],
                   help="also bf16, fp32/float")
    c.add_argument("--json", action="store_true")


def run_bench(args: argparse.Namespace, engine_config) -> int:
    if args.bench == "ceilings":   # the machine, not the engine: no model is loaded here
        return _run_ceilings(args)
    if args.bench == "serve":   # a client of a running server: no model is loaded here
        from twostep.bench.serve import run_serve_bench

        return run_serve_bench(args)
    from twostep.entrypoints.llm import LLM

    config = engine_config(args)
    llm = LLM(**{k: getattr(config, k) for k in config.__slots__})
    tracer = llm.engine.enable_tracing() if args.trace else None
    vocab = llm.engine.model_config.vocab_size
    if args.bench == "throughput":
        from twostep.bench.offline import run_throughput

        result = run_throughput(llm, _workload(args, vocab)).as_dict()
    else:
        from twostep.bench.offline import run_latency

        lens = [int(v) for v in args.input_lens.split(",")]
        result = run_latency(llm, lens, args.output_len, args.batch_size, args.reps, vocab).as_dict()
    print(json.dumps(result) if args.json else _report(args.bench, result))
    if tracer is not None:
        tracer.write(args.trace)
    return 0


def _workload(args: argparse.Namespace, vocab: int) -> list[workloads.BenchRequest]:
    if args.dataset == "nano-vllm":
        return workloads.nano_vllm(vocab, args.num_prompts)
    n = args.num_prompts or 32
    if args.dataset == "random":
        return workloads.uniform(n, workloads.parse_range(args.random_input_range),
                                 workloads.parse_range(args.random_output_range), vocab, args.workload_seed)
    return workloads.fixed(n, args.input_len, args.output_len, vocab, args.workload_seed)


def _report(kind: str, r: dict) -> str:
    if kind == "throughput":
        return (f"{r['num_requests']} requests in {r['elapsed_s']:.2f} s: "
                f"{r['requests_per_s']:.2f} requests/s, {r['output_tokens_per_s']:.1f} output tokens/s, "
                f"{r['total_tokens_per_s']:.1f} total tokens/s\n"
                f"  prompt tokens {r['prompt_tokens']}, output tokens {r['output_tokens']}, "
                f"mean TTFT {r['mean_ttft_ms']:.0f} ms, mean TPOT {r['mean_tpot_ms']:.1f} ms, "
                f"preemptions {r['num_preemptions']}, prefix-cache hit rate {r['prefix_cache_hit_rate']:.1%}"
                + _spec_line(r["spec_decode"]))
    lines = ["prefill (batch 1):"]
    for p in r["prefill"]:
        lines.append(f"  {p['input_len']:>6} tokens: TTFT {p['median_ttft_ms']:.1f} ms, "
                     f"{p['prefill_tokens_per_s']:.0f} tokens/s")
    d = r["decode"]
    lines.append(f"decode (batch {d['batch_size']}, {d['output_len']} tokens): TPOT {d['median_tpot_ms']:.1f} ms "
                 f"(p99 ITL {d['p99_itl_ms']:.1f} ms), {d['decode_tokens_per_s']:.1f} tokens/s"
                 + _spec_line(d["spec_decode"]))
    return "\n".join(lines)


def _spec_line(spec: dict | None) -> str:
    if spec is None:
        return ""
    return (f"\n  speculative decoding: {spec['num_drafts']} drafts, {spec['num_accepted_tokens']}/"
            f"{spec['num_draft_tokens']} draft tokens accepted ({spec['acceptance_rate']:.1%}), "
            f"mean acceptance length {spec['mean_acceptance_length']:.2f}, "
            f"accepted per position {spec['accepted_per_position']}")


def _run_ceilings(args: argparse.Namespace) -> int:
    from twostep.analysis.ceilings import format_ceilings, measure_ceilings, model_bounds

    c = measure_ceilings()
    bounds = None
    if args.model:
        from twostep.analysis.analyze import analyze
        from twostep.models.loader import default_model_path

        name = {"bfloat16": "bf16", "float32": "fp32"}[args.dtype]
        path = default_model_path() if args.model == "default" else args.model
        # the weights as the engine holds them: a quantized file's own format (kept packed), a bf16
        # file's bf16 under float32 too (platforms/cpu/bf16_weights.py), else the compute dtype
        model = analyze(path, hardware="this", kv_dtype=name).model
        if model.bytes_per_weight >= 2 and not (model.weight_format == "bf16" and name == "fp32"):
            model = analyze(path, hardware="this", dtype=name, kv_dtype=name).model
        bounds = model_bounds(c, model.num_params, model.weight_bytes, args.dtype)
    if args.json:
        print(json.dumps({"ceilings": c.as_dict(), "bounds": bounds}))
    else:
        print(format_ceilings(c, bounds, args.model))
    return 0
