"""`twostep generate`: stream one completion and end with a one-line phase summary."""
from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from twostep import __version__
from twostep.config import EngineConfig, PoolerConfig, SpeculativeConfig
from twostep.config.options import add_options, options_from
from twostep.config.replicas import ReplicaConfig
from twostep.entrypoints.reasoning import REASONING_PARSERS
from twostep.sampling_params import SamplingParams


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """A flag for each EngineConfig option, and the short forms of its speculative config's and its
    pooler config's keys (twostep/config/options.py; docs/usage.md lists them)."""
    add_options(p, EngineConfig)
    add_options(p, SpeculativeConfig, dest_prefix=SPECULATIVE_PREFIX)
    add_options(p, PoolerConfig, dest_prefix=POOLER_PREFIX)


SPECULATIVE_PREFIX = "speculative."     # the --speculative-* flags' dests, apart from the engine's
POOLER_PREFIX = "pooler."               # --pooling-type, --normalize, --activation


def speculative_config_from(args: argparse.Namespace) -> dict | None:
    """--speculative-config's JSON with the short flags laid over it; None when none is given."""
    base = SpeculativeConfig.parse(args.speculative_config)
    config = {} if base is None else {k: getattr(base, k) for k in base.__slots__}
    config |= options_from(args, SpeculativeConfig, SPECULATIVE_PREFIX)
    return config or None


def pooler_config_from(args: argparse.Namespace) -> dict | None:
    """--pooler-config's JSON with --pooling-type, --normalize and --activation laid over it."""
    base = PoolerConfig.parse(args.pooler_config)
    config = {} if base is None else {k: getattr(base, k) for k in base.__slots__ if getattr(base, k) is not None}
    config |= options_from(args, PoolerConfig, POOLER_PREFIX)
    return config or None


def engine_config_from(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{**options_from(args, EngineConfig), "speculative_config": speculative_config_from(args),
                           "pooler_config": pooler_config_from(args)})


def add_run_args(p: argparse.ArgumentParser) -> None:
    """What every command that runs the engine takes: --trace, and the engine's options."""
    p.add_argument("--trace", default=None, metavar="FILE.json",
                   help="write a per-step trace (Chrome trace-event JSON, opens in Perfetto)")
    add_engine_args(p)


def _generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate a completion for one prompt, streamed")
    p.add_argument("prompt")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    add_run_args(p)


def _serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the model, as in `vllm serve MODEL` (same as --model)")
    p.add_argument("--uvicorn-log-level", default=None,
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="uvicorn's own log level (default: --log-level)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="accepted for vLLM command lines; twostep always runs eagerly (no graphs to capture)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients use (default: the model folder's or file's base name, "
                        "a hub id as given, or the default model's name)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health (default: "
                        "$TWOSTEP_API_KEY, else $VLLM_API_KEY, else no key)")
    p.add_argument("--api-key-for-metrics", action="store_true",
                   help="with an API key, /metrics needs it too")
    p.add_argument("--max-request-body-bytes", type=int, default=4 << 20,
                   help="answer 413 to a request body over this many bytes (default 4 MiB)")
    p.add_argument("--chat-template", default=None,
                   help="a Jinja chat template file to use instead of the model's")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="let requests send their own chat template (chat_template_kwargs.chat_template); "
                        "a template is code the server runs: only for trusted clients")
    p.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                   help="serve GET /tokenizer_info (special tokens, chat template), for clients that "
                        "tokenize remotely such as lm-eval's tokenizer_backend=remote")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='tool_choice "auto": read tool calls out of the model\'s output (needs '
                        "--tool-call-parser)")
    p.add_argument("--tool-call-parser", default=None,
                   choices=["gpt_oss", "hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder"],
                   help="how the model writes tool calls: hermes (Qwen2.5/3, Hermes, and the fallback "
                        "for templates without tools), llama3_json (Llama 3.1/3.2), mistral, pythonic "
                        "(Llama 3.2/4), qwen3_coder (Qwen3-Coder's XML), gpt_oss (harmony)")
    p.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                   help="split the chain of thought from the answer into message.reasoning (and "
                        "reasoning_content): deepseek_r1 (R1 and its distills), qwen3 (Qwen3, Qwen3.5, "
                        "QwQ), think (other <think> models), gpt_oss (harmony; a harmony model gets it "
                        "anyway)")
    p.add_argument("--structured-outputs-in-reasoning", action="store_true",
                   help="with a reasoning parser, structured outputs constrain the whole output, "
                        "thinking included (default: only the answer after it, as vLLM)")
    p.add_argument("--max-stored-responses", type=int, default=1000,
                   help="responses the Responses API keeps for GET /v1/responses/{id} and previous_response_id "
                        "(store: true); past it the least recently used go (0: none kept)")
    p.add_argument("--max-queued-requests", type=int, default=None,
                   help="sequences (prompts x n) the server queues beyond those it runs: one request "
                        "asking for more gets 400, one arriving at a full queue 503 with Retry-After "
                        "(default: 4 x --max-num-seqs)")
    p.add_argument("--request-timeout", type=float, default=None,
                   help="seconds after which a request is ended (finish_reason length, stop_reason timeout)")
    p.add_argument("--shutdown-grace-period", type=float, default=5.0,
                   help="on SIGINT/SIGTERM, seconds in-flight requests get to finish before they are aborted")
    add_options(p, ReplicaConfig)
    add_run_args(p)


def _proxy_parser(sub) -> None:
    p = sub.add_parser("proxy", help="an OpenAI-compatible front for prefill/decode disaggregation: each "
                                     "request is prefilled on a --prefill instance, then decoded on a --decode one")
    p.add_argument("--prefill", nargs="+", required=True, metavar="URL",
                   help="prefill instances (twostep serve ... --kv-transfer-config with kv_role kv_producer)")
    p.add_argument("--decode", nargs="+", required=True, metavar="URL",
                   help="decode instances (kv_role kv_consumer)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds an instance may take to answer")


def run_proxy(args: argparse.Namespace) -> int:
    from twostep.entrypoints.openai.disagg_proxy import run_proxy as run

    return run(args.prefill, args.decode, args.host, args.port, log_level=args.log_level, timeout=args.timeout)


def _analyze_parser(sub) -> None:
    from twostep.analysis.cli import add_analyze_args

    add_analyze_args(sub.add_parser("analyze", help="roofline and memory analysis of a model on a hardware"))


def _bench_parser(sub) -> None:
    from twostep.bench.cli import add_bench_args

    add_bench_args(sub.add_parser("bench", help="benchmark the engine: throughput, latency"),
                   add_run_args)


def run_bench(args: argparse.Namespace) -> int:
    from twostep.bench.cli import run_bench as run

    return run(args, engine_config_from)


def run_analyze(args: argparse.Namespace) -> int:
    from twostep.analysis.cli import run_analyze as run

    return run(args)


def served_model_name(args: argparse.Namespace) -> str:
    """--served-model-name, else the model's name without any filesystem path: a folder's or
    file's base name (a .gguf without its suffix), a hub id as given."""
    if args.served_model_name:
        return args.served_model_name
    if args.model is None:
        return "SmolLM2-135M-Instruct"
    path = Path(args.model)
    if path.exists():
        return path.stem if path.is_file() else path.resolve().name
    return args.model


def run_serve(args: argparse.Namespace) -> int:
    from twostep.core.execution.tp_group import launched_rank, run_launched_worker
    from twostep.engine.llm_engine import LLMEngine
    from twostep.entrypoints.openai.server import ServerConfig, run_server

    if args.tensor_parallel_size > 1 and launched_rank(args.tensor_parallel_size):
        # torchrun started this rank > 0: a worker of rank 0, no server
        import torch

        backend = "nccl" if args.device.startswith("cuda") or (args.device == "auto" and torch.cuda.is_available()) else "gloo"
        return run_launched_worker(args.tensor_parallel_size, backend, args.distributed_timeout_s)

    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise ValueError(f"the model is given twice: {args.model_tag!r} and --model {args.model!r}")
        args.model = args.model_tag
    api_key = args.api_key or os.environ.get("TWOSTEP_API_KEY") or os.environ.get("VLLM_API_KEY")
    template = Path(args.chat_template).read_text(encoding="utf-8") if args.chat_template else None
    config = ServerConfig(served_model_name(args), template, args.max_queued_requests,
                          args.request_timeout, api_key, args.api_key_for_metrics,
                          args.max_request_body_bytes, args.trust_request_chat_template,
                          model_aliases=(args.model,) if args.model else (),
                          enable_tokenizer_info_endpoint=args.enable_tokenizer_info_endpoint,
                          enable_auto_tool_choice=args.enable_auto_tool_choice,
                          tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
                          structured_outputs_in_reasoning=args.structured_outputs_in_reasoning,
                          max_stored_responses=args.max_stored_responses)
    replicas = ReplicaConfig(**options_from(args, ReplicaConfig))
    if replicas.on_ray:
        from twostep.entrypoints.replicas.launch import run_replicas

        if args.trace:
            raise ValueError("--trace records one engine's steps: run it without replicas")
        return run_replicas(engine_config_from(args), config, replicas, args.host, args.port,
                            log_level=args.uvicorn_log_level or args.log_level,
                            graceful_timeout=args.shutdown_grace_period)
    engine = LLMEngine(engine_config_from(args))
    tracer = engine.enable_tracing() if args.trace else None
    rc = run_server(engine, config, args.host, args.port, log_level=args.uvicorn_log_level or args.log_level,
                    graceful_timeout=args.shutdown_grace_period)
    if tracer is not None:   # the engine thread has stopped: the trace is complete
        tracer.write(args.trace)
    return rc


def run_generate(args: argparse.Namespace) -> int:
    from twostep.engine.llm_engine import LLMEngine

    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, repetition_penalty=args.repetition_penalty, seed=args.sampling_seed,
        stop=args.stop, ignore_eos=args.ignore_eos)
    engine = LLMEngine(engine_config_from(args))
    tracer = engine.enable_tracing() if args.trace else None
    prompt: str | list[int] = args.prompt
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        messages.append({"role": "user", "content": args.prompt})
        prompt = engine.input_processor.encode_chat(messages)
    rid = engine.add_request(prompt, params)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid:
                sys.stdout.write(out.outputs[0].delta_text)
                sys.stdout.flush()
                final = out
    sys.stdout.write("\n")
    engine.shutdown()
    print(summary_line(final, engine), file=sys.stderr)
    if tracer is not None:
        tracer.write(args.trace)
        print(f"trace written to {args.trace} (open it in https://ui.perfetto.dev)", file=sys.stderr)
    return 0


def summary_line(out, engine) -> str:
    m = out.metrics
    n_gen = m.num_generated_tokens
    ttft = m.ttft or 0.0
    tpot = m.tpot
    decode_time = (m.last_token_time - m.first_token_time) if n_gen > 1 else 0.0
    decode_tps = (n_gen - 1) / decode_time if decode_time > 0 else float("nan")
    prefill_tps = m.num_prompt_tokens / ttft if ttft > 0 else float("nan")
    stats = engine.get_stats()
    return (f"[{out.outputs[0].finish_reason}] prompt {m.num_prompt_tokens} tok "
            f"({out.num_cached_tokens} cached) | generated {n_gen} tok | "
            f"TTFT {ttft * 1e3:.1f} ms (prefill {prefill_tps:.0f} tok/s) | "
            f"TPOT {tpot * 1e3 if tpot else float('nan'):.1f} ms (decode {decode_tps:.1f} tok/s) | "
            f"KV blocks {m.num_kv_blocks}/{stats['num_blocks']} x {engine.config.block_size}"
            + (f" | {spec_summary(m.spec_decode)}" if m.spec_decode is not None else ""))


def run_build_kernels(with_test_variants: bool = False) -> int:
    """Each kernel built (or found built) for this CPU; one that cannot build is not an error: the
    engine falls back to PyTorch there (linear_bf16's bf16 inputs also need AVX512-BF16)."""
    from twostep.kernels import build_all

    for name, usable in build_all(with_test_variants).items():
        print(f"{name}: {'ready' if usable else 'not available on this machine (PyTorch fallback)'}")
    return 0


def spec_summary(stats) -> str:
    return (f"spec: {stats.num_accepted_tokens}/{stats.num_draft_tokens} drafts accepted "
            f"({stats.acceptance_rate:.0%}), {stats.mean_acceptance_length:.2f} tok/step, "
            f"per position {stats.accepted_per_position}")


def run_env() -> int:
    import torch

    from twostep.platforms import get_platform
    from twostep.platforms.cpu.report import describe

    print("\n".join(describe(get_platform(torch.device("cpu")))))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="twostep", description=__doc__)
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--version", action="version", version=f"twostep {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _generate_parser(sub)
    _serve_parser(sub)
    _analyze_parser(sub)
    _bench_parser(sub)
    _proxy_parser(sub)
    p = sub.add_parser("build-kernels", help="compile the C++ kernels for this CPU now (else on first use)")
    p.add_argument("--test-variants", action="store_true",
                   help="also the builds the tests check besides the engine's (other instruction sets' paths)")
    sub.add_parser("env", help="this CPU's instruction sets, the default dtype and why, and which kernel "
                               "paths run here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("twostep").setLevel(args.log_level.upper())
    try:
        if args.command == "generate":
            return run_generate(args)
        if args.command == "serve":
            return run_serve(args)
        if args.command == "analyze":
            return run_analyze(args)
        if args.command == "bench":
            return run_bench(args)
        if args.command == "proxy":
            return run_proxy(args)
        if args.command == "build-kernels":
            return run_build_kernels(args.test_variants)
        if args.command == "env":
            return run_env()
    except (ValueError, OSError) as e:   # bad input or a missing file: a message, not a traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
