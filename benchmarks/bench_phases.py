"""Prefill and decode speed of twostep against HF transformers on the same model, side by side.

    .venv/bin/python benchmarks/bench_phases.py                       # default model, bf16 + fp32
    .venv/bin/python benchmarks/bench_phases.py --model DIR --dtypes bfloat16 --batches 1 8

Prefill: one prompt of --prompt-len random tokens, time to first token (median of --reps).
Decode: --batches requests with 16-token prompts, --gen tokens each (ignore EOS), tokens/s
over the decode phase (first token to last). Runs are interleaved (ours, HF, ours, HF...)
because this machine's memory bandwidth drifts; medians are reported.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from twostep import LLM, SamplingParams
from twostep.models.loader import resolve_model_path


def ours_prefill(llm: LLM, n: int, seed: int) -> float:
    vocab = llm.engine.model.config.vocab_size      # ids 100-9999, or within a tiny test vocabulary
    ids = torch.randint(min(100, vocab // 2), min(10000, vocab), (n,),
                        generator=torch.Generator().manual_seed(seed)).tolist()
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
    return n / out.metrics.ttft


def ours_decode(llm: LLM, batch: int, gen: int, seed: int) -> float:
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(100, 10000, (16,), generator=g).tolist() for _ in range(batch)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=gen, ignore_eos=True),
                        use_tqdm=False)
    start = max(o.metrics.first_token_time for o in outs)
    end = max(o.metrics.last_token_time for o in outs)
    tokens = sum(sum(t > start for t in o.metrics.token_times) for o in outs)
    return tokens / (end - start)


class _Stamp:
    def __init__(self):
        self.times = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores


def hf_load(path: str, dtype: torch.dtype):
    import transformers
    from pathlib import Path

    p = Path(path)
    if p.suffix == ".gguf":
        m = transformers.AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name, dtype=dtype)
    else:
        m = transformers.AutoModelForCausalLM.from_pretrained(p, dtype=dtype)
    return m.eval()


@torch.inference_mode()
def hf_prefill(model, n: int, seed: int) -> float:
    ids = torch.randint(100, 10000, (1, n), generator=torch.Generator().manual_seed(seed))
    t0 = time.perf_counter()
    model(ids, logits_to_keep=1)
    return n / (time.perf_counter() - t0)


@torch.inference_mode()
def hf_decode(model, batch: int, gen: int, seed: int) -> float:
    from transformers import LogitsProcessorList

    ids = torch.randint(100, 10000, (batch, 16), generator=torch.Generator().manual_seed(seed))
    stamp = _Stamp()
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=gen, min_new_tokens=gen,
                   do_sample=False, logits_processor=LogitsProcessorList([stamp]), pad_token_id=0)
    return batch * (len(stamp.times) - 1) / (stamp.times[-1] - stamp.times[0])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-hf", action="store_true")
    args = ap.parse_args()
    path = resolve_model_path(args.model)
    results = []
    for dtype in args.dtypes:
        llm = LLM(path, dtype=dtype, kv_cache_memory="1GiB")
        hf = None if args.no_hf else hf_load(path, getattr(torch, dtype))
        ours_prefill(llm, 32, 0)  # warm up
        rows = {"prefill": [], **{f"decode_b{b}": [] for b in args.batches}}
        ref = {k: [] for k in rows}
        for rep in range(args.reps):
            rows["prefill"].append(ours_prefill(llm, args.prompt_len, rep))
            if hf is not None:
                ref["prefill"].append(hf_prefill(hf, args.prompt_len, rep))
            for b in args.batches:
                rows[f"decode_b{b}"].append(ours_decode(llm, b, args.gen, rep))
                if hf is not None:
                    ref[f"decode_b{b}"].append(hf_decode(hf, b, args.gen, rep))
        for k in rows:
            ours = statistics.median(rows[k])
            theirs = statistics.median(ref[k]) if ref[k] else None
            results.append({"dtype": dtype, "phase": k, "twostep_tok_s": round(ours, 1),
                            "hf_tok_s": round(theirs, 1) if theirs else None,
                            "ratio": round(ours / theirs, 2) if theirs else None})
            print(json.dumps(results[-1]), flush=True)
        del llm, hf


if __name__ == "__main__":
    main()
