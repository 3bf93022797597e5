"""What a reasoning parser costs a stream: client-side TPOT of streamed chat completions on one server
started with --reasoning-parser deepseek_r1 (its whole output is thinking, so every token goes
through the parser), with the parser on and, in the same server, off for the request
(chat_template_kwargs enable_thinking false). Requests alternate, each side first in turn; medians
are printed. The parser's own time per token is then clocked in-process on the same output, fed token
by token as the server feeds it: the overhead without the machine's drift.

    .venv/bin/python benchmarks/reasoning_overhead.py                 # the default model, 256 tokens, 5 reps
    .venv/bin/python benchmarks/reasoning_overhead.py --tokens 1024 --reps 3
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from twostep.entrypoints.reasoning import get_reasoning_parser

ROOT = Path(__file__).resolve().parents[1]
PROMPT = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}]


def start_server(port: int, model: str | None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "twostep.cli", "serve", "--port", str(port), "--reasoning-parser", "deepseek_r1"]
    if model:
        cmd += ["--model", model]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("the server did not start")


def stream_once(port: int, tokens: int, parser_on: bool) -> tuple[float, str]:
    """(TPOT in ms: from the first text chunk to the last over the tokens between them, the whole
    streamed text). Per token, not per chunk: a parser holds back a token that may be whitespace
    before a marker and sends it with the next one, so the two sides send different numbers of chunks."""
    body = {"messages": PROMPT, "max_tokens": tokens, "ignore_eos": True, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    if not parser_on:
        body["chat_template_kwargs"] = {"enable_thinking": False}
    times, text, generated = [], [], tokens
    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                generated = chunk["usage"]["completion_tokens"]
            delta = chunk["choices"][0]["delta"] if chunk["choices"] else {}
            piece = (delta.get("reasoning") or "") + (delta.get("content") or "")
            if piece:
                times.append(time.perf_counter())
                text.append(piece)
    return 1e3 * (times[-1] - times[0]) / (generated - 1), "".join(text)


def parser_us_per_token(text: str, pieces: int) -> float:
    """The deepseek_r1 parser fed this text in `pieces` pieces, as a stream: microseconds per piece."""
    step = max(1, len(text) // pieces)
    chunks = [text[i:i + step] for i in range(0, len(text), step)]
    best = float("inf")
    for _ in range(5):
        stream = get_reasoning_parser("deepseek_r1").stream()
        start = time.perf_counter()
        for i, c in enumerate(chunks):
            stream.feed(c, final=i == len(chunks) - 1)
        best = min(best, time.perf_counter() - start)
    return 1e6 * best / len(chunks)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: the packaged SmolLM2-135M-Instruct GGUF")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--port", type=int, default=8123)
    args = ap.parse_args()
    proc = start_server(args.port, args.model)
    try:
        stream_once(args.port, 16, True)                      # warm-up
        on, off, text = [], [], ""
        for rep in range(args.reps):
            for parser_on in ((True, False) if rep % 2 == 0 else (False, True)):   # in turn first
                tpot, streamed = stream_once(args.port, args.tokens, parser_on)
                (on if parser_on else off).append(tpot)
                text = streamed if parser_on else text
            print(f"rep {rep + 1}/{args.reps}: TPOT parser on {on[-1]:.2f} ms, off {off[-1]:.2f} ms", flush=True)
    finally:
        proc.terminate()
        proc.wait(30)
    cost = parser_us_per_token(text, args.tokens)
    on_ms, off_ms = statistics.median(on), statistics.median(off)
    print(f"\nCPU: {_cpu_name()}, {os.cpu_count()} cores; {args.tokens} tokens streamed, {args.reps} reps")
    print("| | TPOT median (ms) |\n|---|---|")
    print(f"| reasoning parser on | {on_ms:.2f} |\n| parser off | {off_ms:.2f} |")
    print(f"| ratio on/off | {on_ms / off_ms:.3f} |")
    print(f"| the parser's own time per token | {cost:.1f} us ({cost / 1e3 / off_ms:.2%} of TPOT) |")


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    main()
