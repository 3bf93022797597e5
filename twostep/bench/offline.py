"""`twostep bench throughput` and `twostep bench latency`: the engine alone, no HTTP.

throughput: every request of a workload submitted at once, continuous batching does the rest;
reports requests/s, output tokens/s and total tokens/s (like `vllm bench throughput`).
latency: the two phases apart: batch-1 prefill tokens/s per prompt length (from TTFT), and
decode TPOT at a batch size.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

from twostep.bench.stats import mean, percentile
from twostep.bench.workloads import BenchRequest
from twostep.sampling_params import SamplingParams


@dataclass(slots=True)
class ThroughputResult:
    num_requests: int
    elapsed_s: float
    prompt_tokens: int
    output_tokens: int
    requests_per_s: float
    output_tokens_per_s: float
    total_tokens_per_s: float
    mean_ttft_ms: float
    mean_tpot_ms: float
    num_preemptions: int
    prefix_cache_hit_rate: float = 0.0
    spec_decode: dict | None = None      # drafts and acceptance, with speculation on

    def as_dict(self) -> dict:
        return asdict(self)


def run_throughput(llm, requests: list[BenchRequest], use_tqdm: bool = True) -> ThroughputResult:
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in requests]
    before = llm.get_stats()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=use_tqdm)
    elapsed = time.perf_counter() - start
    n_in = sum(len(r.prompt_token_ids) for r in requests)
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    return ThroughputResult(
        num_requests=len(requests), elapsed_s=elapsed, prompt_tokens=n_in, output_tokens=n_out,
        requests_per_s=len(requests) / elapsed, output_tokens_per_s=n_out / elapsed,
        total_tokens_per_s=(n_in + n_out) / elapsed,
        mean_ttft_ms=mean([o.metrics.ttft * 1e3 for o in outs]),
        mean_tpot_ms=mean([o.metrics.tpot * 1e3 for o in outs if o.metrics.tpot is not None]),
        num_preemptions=llm.get_stats()["num_preemptions"] - before["num_preemptions"],
        prefix_cache_hit_rate=_hit_rate(before, llm.get_stats()),
        spec_decode=spec_delta(before, llm.get_stats()))


def _hit_rate(before: dict, after: dict) -> float:
    queries = after["prefix_cache_queries"] - before["prefix_cache_queries"]
    return (after["prefix_cache_hits"] - before["prefix_cache_hits"]) / queries if queries else 0.0


def spec_delta(before: dict, after: dict) -> dict | None:
    """Speculative decoding counters over a run (None when speculation is off)."""
    if "spec_decode_num_drafts" not in after:
        return None
    d = {k: after[f"spec_decode_{k}"] - before[f"spec_decode_{k}"]
         for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    d["acceptance_rate"] = d["num_accepted_tokens"] / d["num_draft_tokens"] if d["num_draft_tokens"] else 0.0
    d["mean_acceptance_length"] = 1 + d["num_accepted_tokens"] / d["num_drafts"] if d["num_drafts"] else 0.0
    old = before["spec_decode_accepted_per_position"]
    d["accepted_per_position"] = [n - (old[i] if i < len(old) else 0)
                                  for i, n in enumerate(after["spec_decode_accepted_per_position"])]
    return d


@dataclass(slots=True)
class LatencyResult:
    prefill: list[dict]    # per prompt length: median TTFT and prefill tokens/s
    decode: dict           # batch size, median / p99 TPOT, decode tokens/s

    def as_dict(self) -> dict:
        return asdict(self)


def run_latency(llm, input_lens: list[int], output_len: int, batch_size: int, reps: int,
                vocab_size: int, progress: bool = True) -> LatencyResult:
    from tqdm import tqdm

    from twostep.bench.workloads import fixed

    bar = tqdm(total=(len(input_lens) + 1) * reps, desc="latency runs", unit="run", disable=not progress)
    prefill = []
    for n in input_lens:
        ttfts = []
        for rep in range(reps):
            req = fixed(1, n, 1, vocab_size, seed=rep)[0]
            out = llm.generate([{"prompt_token_ids": req.prompt_token_ids}],
                               SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
            ttfts.append(out.metrics.ttft)
            bar.update(1)
        med = statistics.median(ttfts)
        prefill.append({"input_len": n, "median_ttft_ms": med * 1e3, "prefill_tokens_per_s": n / med})
    itls: list[float] = []
    tpots: list[float] = []
    before = llm.get_stats()
    for rep in range(reps):
        reqs = fixed(batch_size, 16, output_len, vocab_size, seed=100 + rep)
        outs = llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in reqs],
                            SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True),
                            use_tqdm=False)
        for o in outs:
            itls.extend(o.metrics.inter_token_latencies)
            tpots.append(o.metrics.tpot)
        bar.update(1)
    bar.close()
    med_tpot = statistics.median(tpots)
    decode = {"batch_size": batch_size, "output_len": output_len, "median_tpot_ms": med_tpot * 1e3,
              "p99_itl_ms": percentile(itls, 99) * 1e3,
              "decode_tokens_per_s": batch_size / med_tpot,
              "spec_decode": spec_delta(before, llm.get_stats())}
    return LatencyResult(prefill, decode)
