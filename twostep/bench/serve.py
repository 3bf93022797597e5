"""`twostep bench serve`: an online benchmark client for any OpenAI-compatible server.

It sends a seeded workload (the same generators as `bench throughput`) to a running server
(twostep, vLLM, llama-server, ...) over streaming HTTP, with Poisson arrivals and an optional
concurrency cap, and reports what `vllm bench serve` reports, under the same names.

The pieces are kept apart so each can be tested without a network:
  * `poisson_gaps` - the seeded arrival schedule,
  * `SSEParser` - bytes of a text/event-stream -> JSON payloads,
  * `RequestTiming` and `summarize` - pure metric computation from timestamps,
  * `run_benchmark` - the asyncio + httpx client that produces the timings.

Definitions (as in vLLM): TTFT is from sending a request to its first chunk with non-empty
text; ITLs are the gaps between consecutive content chunks, pooled over all requests;
TPOT = (E2EL - TTFT) / (output_tokens - 1), for requests with more than one output token;
E2EL is from sending to the end of the stream. output_tokens is the server's
usage.completion_tokens (requested with stream_options.include_usage), or the number of
content chunks when the server reports no usage. Failed requests (HTTP errors, error events,
broken or unfinished streams) are counted but left out of every latency and token figure.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field

from twostep.bench import workloads
from twostep.bench.stats import mean, percentile

# Prompt ids are drawn below this by default: the server's vocabulary is not known to the
# client, ids under 256 exist in any real one, and performance does not depend on the values.
DEFAULT_VOCAB = 256

# For /v1/chat/completions the prompt must be text and there is no tokenizer on the client:
# each prompt token id becomes one of these words, so a prompt is input_len words (which the
# server's tokenizer and chat template turn into roughly, not exactly, input_len tokens).
CHAT_WORDS = ("the", "of", "and", "to", "in", "is", "was", "for", "on", "as", "with", "by", "at",
              "from", "his", "her", "they", "time", "day", "story", "little", "house", "river",
              "garden", "friend", "morning", "light", "city", "road", "water", "tree", "bird")

DONE = object()   # the `data: [DONE]` sentinel from SSEParser


# ---- arrivals ----------------------------------------------------------------------------------

def poisson_gaps(num_requests: int, rate: float, seed: int = 0) -> list[float]:
    """Seconds to wait before each request: the first goes at once, the others follow after
    exponential gaps of mean 1/rate (a Poisson process). rate=inf sends everything at once."""
    if num_requests <= 0:
        return []
    if math.isinf(rate):
        return [0.0] * num_requests
    if not rate > 0:
        raise ValueError(f"--request-rate must be > 0 or inf, got {rate}")
    rng = random.Random(seed)
    return [0.0] + [rng.expovariate(rate) for _ in range(num_requests - 1)]


# ---- server-sent events ------------------------------------------------------------------------

class SSEParser:
    """Incremental text/event-stream parser: feed() raw bytes as they arrive, in any pieces;
    get the complete events' data back, JSON-decoded, or DONE for `[DONE]`. Comment lines
    (starting with ':') and fields other than data are ignored; an event's several data lines
    are joined with newlines, as the SSE spec says."""

    def __init__(self) -> None:
        self._buf = b""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list:
        self._buf += chunk
        events = []
        while True:
            nl = self._buf.find(b"\n")
            if nl < 0:
                break
            line = self._buf[:nl].rstrip(b"\r").decode("utf-8")
            self._buf = self._buf[nl + 1:]
            event = self._line(line)
            if event is not None:
                events.append(event)
        return events

    def close(self) -> list:
        """The end of the stream: an event left without its blank line is still delivered."""
        events = self.feed(b"\n") if self._buf else []
        if self._data:
            events.append(self._dispatch())
        return events

    def _line(self, line: str):
        if not line:
            return self._dispatch() if self._data else None
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)
        return None

    def _dispatch(self):
        payload = "\n".join(self._data)
        self._data = []
        if payload.strip() == "[DONE]":
            return DONE
        return json.loads(payload)


# ---- metrics -----------------------------------------------------------------------------------

@dataclass(slots=True)
class RequestTiming:
    """One request, in time.perf_counter() seconds: when it was sent, when each content chunk
    arrived, when its stream ended, and how many tokens it generated."""
    start: float
    chunk_times: list[float] = field(default_factory=list)
    output_tokens: int = 0
    end: float = 0.0
    ok: bool = False
    prompt_tokens: int | None = None   # usage.prompt_tokens, when the server reports it
    cached_tokens: int = 0             # usage.prompt_tokens_details.cached_tokens (prefix-cache hits)
    error: str = ""

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.start if self.chunk_times else self.e2el

    @property
    def e2el(self) -> float:
        return self.end - self.start

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)


def _ms_stats(name: str, seconds: list[float]) -> dict[str, float]:
    ms = [s * 1000.0 for s in seconds]
    if not ms:   # vLLM reports 0 for a metric with no samples
        return {f"mean_{name}_ms": 0.0, f"median_{name}_ms": 0.0, f"p99_{name}_ms": 0.0}
    return {f"mean_{name}_ms": mean(ms), f"median_{name}_ms": percentile(ms, 50),
            f"p99_{name}_ms": percentile(ms, 99)}


def summarize(timings: list[RequestTiming], duration: float, input_tokens: list[int]) -> dict:
    """vLLM's serving metrics. input_tokens[i] is request i's prompt length; only successful
    requests count towards tokens, throughput and latencies; failures are only counted."""
    if len(input_tokens) != len(timings):
        raise ValueError("input_tokens needs one prompt length per request")
    good = [(t, n) for t, n in zip(timings, input_tokens) if t.ok]
    total_in = sum(n for _, n in good)
    total_out = sum(t.output_tokens for t, _ in good)
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    result = {
        "completed": len(good),
        "failed": len(timings) - len(good),
        "duration": duration,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": per_s(len(good)),
        "output_throughput": per_s(total_out),
        "total_token_throughput": per_s(total_in + total_out),
        "prefix_cache_hit_rate": sum(t.cached_tokens for t, _ in good) / total_in if total_in else 0.0,
    }
    result.update(_ms_stats("ttft", [t.ttft for t, _ in good]))
    result.update(_ms_stats("tpot", [t.tpot for t, _ in good if t.tpot is not None]))
    result.update(_ms_stats("itl", [gap for t, _ in good for gap in t.itls]))
    result.update(_ms_stats("e2el", [t.e2el for t, _ in good]))
    return result


def format_table(r: dict, request_rate: float, max_concurrency: int | None) -> str:
    """The report in vllm bench serve's layout."""
    row = lambda label, value, fmt="": f"{label:<40} {value:<10{fmt}}"  # noqa: E731
    head = lambda title, c: f"{title:{c}^50}"  # noqa: E731
    lines = [head(" Serving Benchmark Result ", "="),
             row("Successful requests:", r["completed"]),
             row("Failed requests:", r["failed"]),
             row("Maximum request concurrency:", max_concurrency if max_concurrency else "None"),
             row("Request rate configured (RPS):", "inf" if math.isinf(request_rate) else request_rate,
                 "" if math.isinf(request_rate) else ".2f"),
             row("Benchmark duration (s):", r["duration"], ".2f"),
             row("Total input tokens:", r["total_input_tokens"]),
             row("Total generated tokens:", r["total_output_tokens"]),
             row("Request throughput (req/s):", r["request_throughput"], ".2f"),
             row("Output token throughput (tok/s):", r["output_throughput"], ".2f"),
             row("Total token throughput (tok/s):", r["total_token_throughput"], ".2f"),
             row("Prompt tokens from the prefix cache:", f"{r['prefix_cache_hit_rate']:.1%}")]
    for key, title, label in (("ttft", "Time to First Token", "TTFT"),
                              ("tpot", "Time per Output Token (excl. 1st token)", "TPOT"),
                              ("itl", "Inter-token Latency", "ITL"),
                              ("e2el", "End-to-end Latency", "E2EL")):
        lines.append(head(title, "-"))
        for stat in ("mean", "median", "p99"):
            lines.append(row(f"{stat.capitalize() if stat != 'p99' else 'P99'} {label} (ms):",
                             r[f"{stat}_{key}_ms"], ".2f"))
    lines.append("=" * 50)
    return "\n".join(lines)


# ---- the client --------------------------------------------------------------------------------

def chat_text(prompt_token_ids: list[int]) -> str:
    return " ".join(CHAT_WORDS[t % len(CHAT_WORDS)] for t in prompt_token_ids)


def request_body(endpoint: str, model: str, req: workloads.BenchRequest) -> dict:
    body = {"model": model, "max_tokens": req.output_len, "ignore_eos": True, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}}
    if endpoint.rstrip("/").endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": chat_text(req.prompt_token_ids)}]
    else:
        body["prompt"] = list(req.prompt_token_ids)
    return body


def _apply_event(timing: RequestTiming, event, now: float) -> bool:
    """Fold one SSE payload into timing; True if it ends the request ([DONE] or a finish_reason)."""
    if event is DONE:
        return True
    if not isinstance(event, dict):
        raise ValueError(f"unexpected stream payload {event!r}")
    if event.get("error"):
        err = event["error"]
        raise ValueError(err.get("message", str(err)) if isinstance(err, dict) else str(err))
    finished = False
    for choice in event.get("choices") or []:
        text = choice.get("text")
        if text is None:
            text = (choice.get("delta") or {}).get("content")
        if text:
            timing.chunk_times.append(now)
        finished |= bool(choice.get("finish_reason"))
    usage = event.get("usage")
    if usage:
        if usage.get("completion_tokens") is not None:
            timing.output_tokens = int(usage["completion_tokens"])
        if usage.get("prompt_tokens") is not None:
            timing.prompt_tokens = int(usage["prompt_tokens"])
        timing.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return finished


async def send_request(client, url: str, body: dict, headers: dict) -> RequestTiming:
    """One streaming request; never raises: a failure is a RequestTiming with ok=False."""
    import httpx

    timing = RequestTiming(start=time.perf_counter())
    complete = False
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode("utf-8", "replace")
                raise ValueError(f"HTTP {resp.status_code}: {text[:300]}")
            parser = SSEParser()
            async for chunk in resp.aiter_bytes():
                now = time.perf_counter()
                for event in parser.feed(chunk):
                    complete |= _apply_event(timing, event, now)
            for event in parser.close():
                complete |= _apply_event(timing, event, time.perf_counter())
        timing.end = time.perf_counter()
        if not complete:
            raise ValueError("the stream ended before the request finished")
        if timing.output_tokens == 0:
            timing.output_tokens = len(timing.chunk_times)   # the server reported no usage
        timing.ok = True
    except (httpx.HTTPError, ValueError, UnicodeDecodeError) as e:
        timing.end = timing.end or time.perf_counter()
        timing.error = f"{type(e).__name__}: {e}"
        timing.ok = False
    return timing


async def run_benchmark(base_url: str, endpoint: str, model: str,
                        requests: list[workloads.BenchRequest], request_rate: float = math.inf,
                        max_concurrency: int | None = None, seed: int = 0,
                        api_key: str | None = None, progress: bool = True) -> tuple[list[RequestTiming], float]:
    """Send every request on the Poisson schedule; (timings in request order, duration). A progress
    bar on stderr counts finished requests."""
    import httpx
    from tqdm import tqdm

    url = base_url.rstrip("/") + "/" + endpoint.lstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    gaps = poisson_gaps(len(requests), request_rate, seed)
    offsets, t = [], 0.0
    for g in gaps:
        t += g
        offsets.append(t)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    limits = httpx.Limits(max_connections=max_concurrency or None, max_keepalive_connections=None)
    timeout = httpx.Timeout(6 * 3600.0, connect=30.0)
    bar = tqdm(total=len(requests), desc="requests", unit="req", disable=not progress)
    finished = [asyncio.Event() for _ in requests]     # a conversation's next turn waits for this one
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        t0 = time.perf_counter()

        async def one(i: int, req: workloads.BenchRequest, offset: float) -> RequestTiming:
            if req.after is not None:
                await finished[req.after].wait()
            delay = t0 + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            body = request_body(endpoint, model, req)
            if sem is None:
                timing = await send_request(client, url, body, headers)
            else:
                async with sem:
                    timing = await send_request(client, url, body, headers)
            finished[i].set()
            bar.update(1)
            return timing

        timings = await asyncio.gather(*(one(i, r, o) for i, (r, o) in enumerate(zip(requests, offsets))))
        duration = time.perf_counter() - t0
    bar.close()
    return list(timings), duration


def first_model(base_url: str, api_key: str | None = None) -> str:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = base_url.rstrip("/") + "/v1/models"
    try:
        resp = httpx.get(url, headers=headers, timeout=30.0)
        resp.raise_for_status()
        return resp.json()["data"][0]["id"]
    except httpx.HTTPError as e:
        raise OSError(f"cannot list the models at {url}: {e}") from None
    except (KeyError, IndexError, TypeError, ValueError):
        raise ValueError(f"{url} did not list any model; pass --model") from None


# ---- the command -------------------------------------------------------------------------------

def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="the server's root URL (a trailing /v1, as OpenAI clients write it, is fine)")
    p.add_argument("--endpoint", default="/v1/completions",
                   help="/v1/completions (prompts as token ids) or /v1/chat/completions "
                        "(prompts as synthetic text of input-len words)")
    p.add_argument("--model", default=None, help="model name to send (default: the first of GET /v1/models)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="bearer token (default: $OPENAI_API_KEY)")
    p.add_argument("--dataset", choices=["fixed", "random", "nano-vllm", "long-short", "shared-prefix"],
                   default="fixed",
                   help="fixed lengths, random lengths in ranges, nano-vllm's shared workload, or "
                        "long-short: --num-prompts short requests (--input-len, --output-len) with "
                        "--long-prompts long ones spread among them")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="requests (default: 32; nano-vllm: its 256, or its first N)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--random-input-range", default="100:1024", help="with --dataset random")
    p.add_argument("--random-output-range", default="100:1024", help="with --dataset random")
    p.add_argument("--long-prompts", type=int, default=4, help="with --dataset long-short")
    p.add_argument("--long-input-len", type=int, default=2048, help="with --dataset long-short")
    p.add_argument("--long-output-len", type=int, default=16, help="with --dataset long-short")
    p.add_argument("--conversations", type=int, default=8,
                   help="with --dataset shared-prefix: chats under one system prompt of --input-len tokens, "
                        "--turns turns each of --turn-len user tokens and --output-len answer tokens")
    p.add_argument("--turns", type=int, default=4, help="with --dataset shared-prefix")
    p.add_argument("--turn-len", type=int, default=64, help="with --dataset shared-prefix")
    p.add_argument("--workload-seed", type=int, default=0)
    p.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB,
                   help=f"prompt token ids are drawn below this (default {DEFAULT_VOCAB}: valid for any "
                        "real vocabulary; performance does not depend on the ids)")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests per second, Poisson arrivals (default: inf, all at once)")
    p.add_argument("--max-concurrency", type=int, default=None, help="the most requests in flight")
    p.add_argument("--seed", type=int, default=0, help="seed of the arrival times")
    p.add_argument("--save-json", default=None, metavar="FILE", help="write the results as JSON")
    p.add_argument("--json", action="store_true", help="print the results as JSON instead of the table")


def build_workload(args: argparse.Namespace) -> list[workloads.BenchRequest]:
    if args.dataset == "nano-vllm":
        return workloads.nano_vllm(args.vocab_size, args.num_prompts)
    n = args.num_prompts or 32
    if args.dataset == "long-short":
        return workloads.long_and_short(n, args.input_len, args.output_len, args.long_prompts,
                                        args.long_input_len, args.long_output_len, args.vocab_size,
                                        args.workload_seed)
    if args.dataset == "shared-prefix":
        return workloads.shared_prefix(args.conversations, args.turns, args.input_len, args.turn_len,
                                       args.output_len, args.vocab_size, args.workload_seed)
    if args.dataset == "random":
        return workloads.uniform(n, workloads.parse_range(args.random_input_range),
                                 workloads.parse_range(args.random_output_range), args.vocab_size,
                                 args.workload_seed)
    return workloads.fixed(n, args.input_len, args.output_len, args.vocab_size, args.workload_seed)


def server_root(base_url: str) -> str:
    """The server's root from --base-url, which may end in /v1 as OpenAI clients' base URLs do."""
    root = base_url.rstrip("/")
    return root[:-len("/v1")] if root.endswith("/v1") else root


def run_serve_bench(args: argparse.Namespace) -> int:
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    args.base_url = server_root(args.base_url)
    requests = build_workload(args)
    model = args.model or first_model(args.base_url, args.api_key)
    timings, duration = asyncio.run(run_benchmark(
        args.base_url, args.endpoint, model, requests, args.request_rate, args.max_concurrency,
        args.seed, args.api_key))
    input_tokens = [t.prompt_tokens if t.prompt_tokens is not None else len(r.prompt_token_ids)
                    for t, r in zip(timings, requests)]
    result = summarize(timings, duration, input_tokens)
    errors = [t.error for t in timings if not t.ok]
    for e in errors[:5]:
        print(f"failed request: {e}", file=sys.stderr)
    rate = args.request_rate
    saved = {**result, "model": model, "endpoint": args.endpoint, "num_prompts": len(requests),
             "request_rate": "inf" if math.isinf(rate) else rate, "max_concurrency": args.max_concurrency,
             "errors": errors}
    if args.save_json:
        with open(args.save_json, "w") as f:
            json.dump(saved, f, indent=2)
    print(json.dumps(saved) if args.json else format_table(result, rate, args.max_concurrency))
    return 0
