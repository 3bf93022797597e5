"""The measurement behind dtype="auto": speed and exactness of bfloat16 against float32.

    .venv/bin/python benchmarks/dtype_auto.py [--model M] [--tokens 48]

For 8 chat prompts on the model: greedy tokens in each dtype, submitted together and one by
one, against transformers' float32 greedy tokens on the same file; plus decode and prefill speed.
Agreement is reported as the fraction of prompts whose tokens are identical, and the mean
number of leading tokens that agree.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from twostep import LLM, SamplingParams
from twostep.models.loader import resolve_model_path

QUESTIONS = ["What is the capital of France?", "Name three primary colours.",
             "Write a haiku about the sea.", "What is 12 times 7?",
             "Explain photosynthesis in one sentence.", "Who wrote Romeo and Juliet?",
             "Give me a synonym for happy.", "What is the boiling point of water in Celsius?"]


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    same = sum(x == y for x, y in zip(a, b))
    prefix = [next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
              for x, y in zip(a, b)]
    return {"identical": f"{same}/{len(a)}", "mean_leading_agreement": sum(prefix) / len(prefix)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=48)
    args = ap.parse_args()
    path = resolve_model_path(args.model)
    params = SamplingParams(temperature=0, max_tokens=args.tokens)
    results, tokens = {}, {}
    for dtype in ("float32", "bfloat16"):
        llm = LLM(path, dtype=dtype, kv_cache_memory="512MiB", enable_prefix_caching=False)
        prompts = [{"prompt_token_ids": llm.tokenizer.encode_chat([{"role": "user", "content": q}])}
                   for q in QUESTIONS]
        t0 = time.perf_counter()
        batched = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        batch_time = time.perf_counter() - t0
        alone = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
        tokens[dtype] = (prompts, batched, alone)
        results[dtype] = {"batched_vs_alone": agreement(batched, alone),
                          "batch_tok_s": round(sum(map(len, batched)) / batch_time, 1)}
    import transformers

    p = Path(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        p.parent, gguf_file=p.name, dtype=torch.float32) if p.suffix == ".gguf" else \
        transformers.AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32)
    prompts = tokens["float32"][0]
    ref = []
    for prompt in prompts:
        ids = torch.tensor([prompt["prompt_token_ids"]])
        out = hf.generate(ids, max_new_tokens=args.tokens, do_sample=False)[0, ids.shape[1]:].tolist()
        ref.append(out)
    for dtype, (_, batched, alone) in tokens.items():
        # HF stops at EOS and keeps it; compare over what both produced
        results[dtype]["alone_vs_hf_fp32"] = agreement(alone, [r[:len(a)] for r, a in zip(ref, alone)])
    results["bf16_speedup_batched"] = round(results["bfloat16"]["batch_tok_s"] / results["float32"]["batch_tok_s"], 2)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
