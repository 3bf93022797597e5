"""One workload through twostep and HF transformers (and llama.cpp where it is installed),
in one process, with the ratios.

    .venv/bin/python benchmarks/compare.py [--model M] [--num-prompts 8] [--dtype bfloat16]

Workload: the first --num-prompts requests of nano-vllm's shared workload (input and output
lengths uniform in 100..1024, seed 0), token ids, ignore EOS, so every engine does the same work.
twostep gets all requests at once (continuous batching). HF transformers gets its best static
batching: all prompts in one left-padded batch, generating until the longest output is done
(only the requested tokens count). llama.cpp is reported as missing unless llama_cpp imports
(PERFORMANCE-NOTES.md says how to build it here).
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from twostep import LLM, SamplingParams
from twostep.bench import workloads
from twostep.models.loader import resolve_model_path


def run_twostep(path: str, dtype: str, reqs) -> float:
    llm = LLM(path, dtype=dtype, enable_prefix_caching=False)
    params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in reqs]
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in reqs], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert [len(o.outputs[0].token_ids) for o in outs] == [r.output_len for r in reqs]
    return sum(r.output_len for r in reqs) / elapsed


def run_hf(path: str, dtype: str, reqs, batch_size: int) -> float:
    import transformers
    from pathlib import Path

    p = Path(path)
    kwargs = {"gguf_file": p.name} if p.suffix == ".gguf" else {}
    model = transformers.AutoModelForCausalLM.from_pretrained(
        p.parent if p.suffix == ".gguf" else p, dtype=getattr(torch, dtype), **kwargs).eval()
    start = time.perf_counter()
    for i in range(0, len(reqs), batch_size):
        batch = reqs[i:i + batch_size]
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, r in enumerate(batch):        # left padding, as generation needs
            ids[j, width - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
            mask[j, width - len(r.prompt_token_ids):] = 1
        longest = max(r.output_len for r in batch)
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                           do_sample=False, pad_token_id=0)
    elapsed = time.perf_counter() - start
    return sum(r.output_len for r in reqs) / elapsed


def llama_cpp_status() -> str:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return "not installed (see shared/PERFORMANCE-NOTES.md: build llama-cpp-python from its sdist)"
    return "installed, but this script does not drive it yet"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--hf-batch-size", type=int, default=None, help="default: all prompts in one batch")
    args = ap.parse_args()
    path = resolve_model_path(args.model)
    reqs = workloads.nano_vllm(vocab_size=10000, num_prompts=args.num_prompts)
    ours = run_twostep(path, args.dtype, reqs)
    hf = run_hf(path, args.dtype, reqs, args.hf_batch_size or len(reqs))
    print(json.dumps({
        "workload": f"nano-vllm first {len(reqs)} requests",
        "prompt_tokens": sum(len(r.prompt_token_ids) for r in reqs),
        "output_tokens": sum(r.output_len for r in reqs),
        "dtype": args.dtype,
        "twostep_output_tok_s": round(ours, 1), "hf_static_batch_output_tok_s": round(hf, 1),
        "ratio_twostep_over_hf": round(ours / hf, 2),
        "llama_cpp": llama_cpp_status(),
    }, indent=1))


if __name__ == "__main__":
    main()
