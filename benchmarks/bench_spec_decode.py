"""Speculative decoding on an input-grounded workload: decode speed with and without it.

    .venv/bin/python benchmarks/bench_spec_decode.py [--model M] [--reps 3] [--batch-sizes 1,2,4,8,16]

Workload: chat requests that ask the model to repeat or lightly edit a given paragraph (the output
copies the input, which is where prompt lookup pays), greedy, 128 new tokens at most. Engines,
all loaded once and run interleaved rep by rep (this machine's bandwidth drifts):

  * plain: no speculation;
  * ngram k=2 / k=4: prompt lookup;
  * fp32 target alone, and fp32 target with the same model in bf16 as its draft ("the target
    itself in a cheaper dtype"; the default model is already the smallest of its family).

Batch 1 reports decode tokens/s ((generated - 1) / (last token - first token)), acceptance and how
many outputs equal the plain run's; larger batches report output tokens/s of the whole batch, to
find the batch size at which speculation stops paying on this CPU.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from twostep import LLM, SamplingParams
from twostep.bench.offline import spec_delta
from twostep.models.loader import resolve_model_path

PARAGRAPHS = [
    "The old lighthouse stood at the edge of the cliff for more than a hundred years. Every night its "
    "lamp turned slowly, sending a beam across the dark water so that ships could find their way home.",
    "Photosynthesis is the process by which green plants use sunlight, water and carbon dioxide to make "
    "glucose and oxygen. It takes place mainly in the leaves, inside small structures called chloroplasts.",
    "To make a simple tomato sauce, warm olive oil in a pan, add chopped garlic and cook it gently. Then "
    "add crushed tomatoes, a pinch of salt and a few basil leaves, and let it simmer for twenty minutes.",
    "The library opens at nine in the morning and closes at six in the evening from Monday to Friday. On "
    "Saturdays it opens at ten and closes at two, and it is closed on Sundays and public holidays.",
]
TASKS = ["Repeat the following text exactly, word for word:\n\n{}",
         "Rewrite the following text, changing only the first sentence to the past perfect tense:\n\n{}"]


def prompts(n: int) -> list[list[dict]]:
    all_prompts = [[{"role": "user", "content": t.format(p)}] for t in TASKS for p in PARAGRAPHS]
    return [all_prompts[i % len(all_prompts)] for i in range(n)]


def engines(model: str | None) -> dict[str, LLM]:
    model = resolve_model_path(model)
    common = dict(enable_prefix_caching=False, kv_cache_memory="1GiB")
    return {
        "plain": LLM(model, **common),
        "ngram k=2": LLM(model, speculative_config={"method": "ngram", "num_speculative_tokens": 2}, **common),
        "ngram k=4": LLM(model, speculative_config={"method": "ngram", "num_speculative_tokens": 4}, **common),
        "fp32": LLM(model, dtype="float32", **common),
        "fp32 + bf16 draft": LLM(model, dtype="float32", **common, speculative_config={
            "method": "draft_model", "model": model, "dtype": "bfloat16",
            "num_speculative_tokens": 4}),
    }


def run(llm: LLM, batch: list, params: SamplingParams) -> dict:
    before = llm.get_stats()
    start = time.perf_counter()
    outs = llm.chat(batch, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    after = llm.get_stats()
    m = outs[0].metrics
    n = m.num_generated_tokens
    spec = spec_delta(before, after) or {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0}
    return {"decode_tok_s": (n - 1) / (m.last_token_time - m.first_token_time) if n > 1 else 0.0,
            "output_tok_s": sum(len(o.outputs[0].token_ids) for o in outs) / elapsed,
            "tokens": [o.outputs[0].token_ids for o in outs], **spec}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batch-sizes", default="1,2,4,8,16")
    args = ap.parse_args()
    llms = engines(args.model)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    for size in [int(b) for b in args.batch_sizes.split(",")]:
        names = list(llms) if size == 1 else ["plain", "ngram k=2", "ngram k=4"]
        results: dict[str, list[dict]] = {name: [] for name in names}
        for rep in range(args.reps):
            for i in range(len(PARAGRAPHS) * len(TASKS) if size == 1 else 1):
                batch = prompts(i + size)[i:] if size == 1 else prompts(size)
                for name in names:
                    results[name].append(run(llms[name], batch, params))
        for name in names:
            rs = results[name]
            base = results["fp32" if name.startswith("fp32") else "plain"]
            drafted = sum(r["num_draft_tokens"] for r in rs)
            row = {"batch_size": size, "engine": name,
                   "decode_tok_s": round(statistics.median(r["decode_tok_s"] for r in rs), 1),
                   "output_tok_s": round(statistics.median(r["output_tok_s"] for r in rs), 1),
                   "acceptance_rate": round(sum(r["num_accepted_tokens"] for r in rs) / drafted, 3)
                   if drafted else None,
                   "mean_acceptance_length": round(1 + sum(r["num_accepted_tokens"] for r in rs)
                                                   / sum(r["num_drafts"] for r in rs), 2) if drafted else None,
                   "same_tokens_as_plain": sum(a["tokens"] == b["tokens"] for a, b in zip(rs, base)) / len(rs)}
            key = "decode_tok_s" if size == 1 else "output_tok_s"
            row["speedup"] = round(row[key] / statistics.median(r[key] for r in base), 2)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
