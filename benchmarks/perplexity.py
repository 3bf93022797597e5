"""Perplexity of a GGUF file on a text, twostep against llama.cpp's `llama-perplexity`, computed the
way llama-perplexity does: the text's tokens (with BOS where the vocabulary adds one) cut into chunks
of --ctx tokens, each chunk's first token replaced by BOS where the vocabulary adds one, and only the
second half of each chunk scored.

    .venv/bin/python benchmarks/perplexity.py FILE.gguf TEXT [--ctx 512] [--chunks N] [--threads 2]

twostep's figure comes from prompt logprobs (one request per chunk), through the same kernels as
serving (chunks of more than 32 rows: dequantized tiles; --decode-path scores with forwards of at
most 32 rows, i.e. through the matrix-vector kernel; --int8-activations through the int8 product,
llama.cpp's own activation precision). llama-perplexity is found as compare.py finds
llama.cpp's tools ($LLAMA_CPP_BIN_DIR, else PATH).
"""
from __future__ import annotations

import argparse
import math
import os
import re
import shutil
import subprocess
import time
from pathlib import Path


def llama_perplexity_bin() -> str | None:
    folder = os.environ.get("LLAMA_CPP_BIN_DIR")
    if folder and (Path(folder) / "llama-perplexity").is_file():
        return str(Path(folder) / "llama-perplexity")
    return shutil.which("llama-perplexity")


def twostep_perplexity(path: str, text: str, ctx: int, chunks: int | None, threads: int,
                       decode_path: bool, int8_activations: bool = False) -> tuple[float, int, float]:
    """int8_activations: --cpu-int8-activations all (every forward here is a prompt's, which the
    default, decode, leaves at 16 bits)."""
    from twostep import LLM, SamplingParams
    from twostep.platforms.cpu.quant_linear import GEMV_MAX_ROWS

    extra = {"max_num_batched_tokens": GEMV_MAX_ROWS} if decode_path else {}
    llm = LLM(path, dtype="float32", num_threads=threads, enable_prefix_caching=False,
              kv_cache_memory="512MiB", max_model_len=ctx + 1, cpu_int8_activations="all" if int8_activations else "decode", **extra)
    engine = llm.engine
    tokens = engine.tokenizer.encode(text, add_special_tokens=True)
    bos = chunk_start_token(engine)
    n = len(tokens) // ctx if chunks is None else min(chunks, len(tokens) // ctx)
    prompts = []
    for i in range(n):
        chunk = list(tokens[i * ctx:(i + 1) * ctx])
        if bos is not None:
            chunk[0] = bos
        prompts.append({"prompt_token_ids": chunk})
    start = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    elapsed = time.perf_counter() - start
    nll, count = 0.0, 0
    first = ctx // 2
    for prompt, out in zip(prompts, outs):
        ids = prompt["prompt_token_ids"]
        for j in range(first + 1, ctx):      # token j scored from the logits at j - 1
            nll -= out.prompt_logprobs[j][ids[j]].logprob
            count += 1
    return math.exp(nll / count), n, elapsed


def chunk_start_token(engine) -> int | None:
    """BOS where the tokenizer adds one to a text (GGUF: tokenizer.ggml.add_bos_token), else None:
    llama-perplexity writes BOS over each chunk's first token only where its vocabulary adds BOS
    (llama_vocab_get_add_bos); a Qwen2 file names a BOS id but does not add it."""
    bos = engine.model_config.bos_token_id if hasattr(engine.model_config, "bos_token_id") else None
    bos = bos if bos is not None else engine.generation_config.get("bos_token_id")
    adds = engine.tokenizer.encode("a", add_special_tokens=True)[:1] == [bos]
    return bos if bos is not None and adds else None


def llama_cpp_perplexity(binary: str, path: str, text_file: str, ctx: int, chunks: int | None,
                         threads: int) -> tuple[float, str]:
    cmd = [binary, "-m", path, "-f", text_file, "-c", str(ctx), "-t", str(threads), "-b", str(ctx)]
    if chunks is not None:
        cmd += ["--chunks", str(chunks)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0 and "--repack" not in " ".join(cmd):
        out = subprocess.run(cmd + ["--repack", "0"], capture_output=True, text=True)   # AMX SIGILL
    match = re.search(r"Final estimate: PPL = ([0-9.]+)", out.stdout + out.stderr)
    if not match:
        raise SystemExit(f"llama-perplexity failed:\n{(out.stdout + out.stderr)[-3000:]}")
    return float(match.group(1)), " ".join(cmd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("gguf")
    ap.add_argument("text")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--decode-path", action="store_true")
    ap.add_argument("--int8-activations", action="store_true",
                    help="twostep with --cpu-int8-activations all (activations rounded to int8 as llama.cpp does)")
    args = ap.parse_args()
    text = Path(args.text).read_text()
    ppl, n, seconds = twostep_perplexity(args.gguf, text, args.ctx, args.chunks, args.threads, args.decode_path,
                                         args.int8_activations)
    print(f"twostep:   PPL {ppl:.4f} over {n} chunks of {args.ctx} ({seconds:.1f} s)")
    binary = llama_perplexity_bin()
    if binary is None:
        print("llama.cpp: llama-perplexity not found (docs/benchmarking.md)")
        return
    theirs, cmd = llama_cpp_perplexity(binary, args.gguf, args.text, args.ctx, args.chunks or n, args.threads)
    print(f"llama.cpp: PPL {theirs:.4f}  ({cmd})")
    print(f"twostep / llama.cpp: {ppl / theirs:.4f} ({100 * (ppl / theirs - 1):+.2f}%)")


if __name__ == "__main__":
    main()
