"""What structured outputs cost: decode time per token with a JSON-schema constraint against the
same requests unconstrained, at batch 1 and 8 on the default model, and grammar compile time per
schema (cold, then from the cache).

    .venv/bin/python benchmarks/structured_outputs.py                  # batches 1 8, 5 reps
    .venv/bin/python benchmarks/structured_outputs.py --reps 3 --json

The constrained requests ask for an array of 48 integers (a fixed-length output of ~190 tokens,
so both sides decode the same number of tokens); the unconstrained ones run the same prompt with
ignore_eos to the same length. Constrained and free batches alternate (in turn first), and medians
are printed: the machine's speed drifts between minutes, so the TPOT ratio carries that noise. The
constraints' own time per step (the grammar's bitmask, its advance by the sampled token, and the
sampler's masking) is clocked inside the constrained runs: mask_share_of_step is that time over the
constrained TPOT, the overhead without the drift. Compile times use the twenty
schemas of tests/structured_output/schemas.py.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from pathlib import Path

from twostep.entrypoints.llm import LLM
from twostep.sample import sampler as sampler_module
from twostep.sampling_params import SamplingParams, StructuredOutputsParams
from twostep.structured_output.compiler import GrammarCompiler
from twostep.structured_output.grammar import Grammar

ARRAY = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": 48, "maxItems": 48}
PROMPT = "List forty-eight numbers between 0 and 999 as a JSON array."
SCHEMAS_FILE = Path(__file__).resolve().parents[1] / "tests" / "structured_output" / "schemas.py"


class MaskClock:
    """Seconds spent on constraints while installed: the grammar's bitmask and its advance
    (Grammar.bitmask, Grammar.accept) and the sampler's masking step (apply_constraints)."""

    def __init__(self) -> None:
        self.seconds, self.calls = 0.0, 0
        self._originals = [(Grammar, "bitmask"), (Grammar, "accept"), (sampler_module, "apply_constraints")]
        self._originals = [(owner, name, getattr(owner, name)) for owner, name in self._originals]

    def __enter__(self):
        for owner, name, original in self._originals:
            setattr(owner, name, self._timed(original, count=name == "bitmask"))
        return self

    def __exit__(self, *exc):
        for owner, name, original in self._originals:
            setattr(owner, name, original)

    def _timed(self, fn, count: bool):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
                self.calls += count
        return timed


def tpot_ms(outputs) -> float:
    """Median time per output token after the first, over the batch's requests."""
    per = [(o.metrics.last_token_time - o.metrics.first_token_time) / (len(o.outputs[0].token_ids) - 1)
           for o in outputs]
    return 1e3 * statistics.median(per)


def run_batches(llm: LLM, batch: int, reps: int) -> dict:
    prompt = {"prompt_token_ids": llm.engine.input_processor.encode_chat([{"role": "user", "content": PROMPT}])}
    constrained = SamplingParams(temperature=0, max_tokens=400,
                                 structured_outputs=StructuredOutputsParams(json=ARRAY))
    first = llm.generate([prompt], constrained, use_tqdm=False)[0].outputs[0]
    json.loads(first.text)                                   # the constraint held
    length = len(first.token_ids)
    free = SamplingParams(temperature=0, max_tokens=length, ignore_eos=True)
    llm.generate([prompt], free, use_tqdm=False)             # warm both paths
    with_mask, without, mask_ms = [], [], []
    for rep in range(reps):
        for side in ("constrained", "free") if rep % 2 == 0 else ("free", "constrained"):
            if side == "free":
                without.append(tpot_ms(llm.generate([prompt] * batch, free, use_tqdm=False)))
                continue
            with MaskClock() as clock:
                outs = llm.generate([prompt] * batch, constrained, use_tqdm=False)
            with_mask.append(tpot_ms(outs))
            mask_ms.append(1e3 * clock.seconds / max(len(o.outputs[0].token_ids) for o in outs))
    c, f = statistics.median(with_mask), statistics.median(without)
    return {"batch": batch, "output_tokens": length, "tpot_ms_constrained": round(c, 2),
            "tpot_ms_free": round(f, 2), "decode_tok_s_constrained": round(1e3 * batch / c, 1),
            "decode_tok_s_free": round(1e3 * batch / f, 1), "overhead": round(c / f - 1, 3),
            "mask_ms_per_step": round(statistics.median(mask_ms), 3),
            "mask_share_of_step": round(statistics.median(mask_ms) / c, 3)}


def compile_times(llm: LLM) -> dict:
    spec = importlib.util.spec_from_file_location("schemas", SCHEMAS_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    compiler = GrammarCompiler(llm.engine.tokenizer, llm.engine.model_config.vocab_size, llm.engine.eos_token_ids)
    start = time.perf_counter()
    compiler.ll_tokenizer
    table_s = time.perf_counter() - start
    cold, cached, first_mask = [], [], []
    for schema in module.SCHEMAS.values():
        params = StructuredOutputsParams(json=schema)
        start = time.perf_counter()
        grammar = compiler.grammar(params)
        cold.append(time.perf_counter() - start)
        start = time.perf_counter()
        grammar.bitmask()
        first_mask.append(time.perf_counter() - start)
        start = time.perf_counter()
        compiler.grammar(params)
        cached.append(time.perf_counter() - start)
    ms = lambda xs: round(1e3 * statistics.median(xs), 3)  # noqa: E731
    return {"schemas": len(cold), "token_table_s": round(table_s, 2), "compile_ms_median": ms(cold),
            "compile_ms_max": round(1e3 * max(cold), 2), "first_mask_ms_median": ms(first_mask),
            "cached_ms_median": ms(cached)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the packaged SmolLM2-135M-Instruct GGUF")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", action="store_true", help="one JSON object instead of lines")
    args = ap.parse_args()
    llm = LLM(args.model)
    result = {"compile": compile_times(llm), "decode": []}
    for batch in args.batches:
        row = run_batches(llm, batch, args.reps)
        result["decode"].append(row)
        if not args.json:
            print(json.dumps(row), flush=True)
    print(json.dumps(result if args.json else result["compile"]))


if __name__ == "__main__":
    main()
