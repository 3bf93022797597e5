"""twostep side by side with HF transformers and llama.cpp, in one process, with the ratios.

    .venv/bin/python benchmarks/make_shape.py                  # once: Qwen2.5-0.5B shape, HF + GGUF
    .venv/bin/python benchmarks/compare.py --mode phases [--reps 5] [--json out.json]
    .venv/bin/python benchmarks/compare.py --mode throughput [--model M] [--num-prompts 8]

phases (the performance issue's targets, on the Qwen2.5-0.5B shape from
make_shape.py, bf16): prefill of one --prompt-len prompt (tokens/s from the time to first
token), and decode at each of --batches: --decode-prompt-len-token prompts, --gen tokens each,
tokens/s over the tokens after the first. Per repetition and phase the engines run back to back
(twostep, HF, llama.cpp, twostep, ...) because this machine's memory bandwidth drifts; the table
gives medians over --reps and the ratios.
  twostep: LLM.generate on token ids, ignore_eos.
  HF transformers: generate with min_new_tokens = max_new_tokens; timestamps from a logits
    processor, which runs once per generated token.
  llama.cpp, on the GGUF (--gguf, default MODEL/model-bf16.gguf): `llama-bench -p N -n 0`
    (prefill), `llama-bench -p 0 -n G -d P` (decode batch 1: tgG after a P-token context),
    `llama-batched-bench -npp P -ntg G -npl B` (decode batch B), all with -t --threads. Binaries
    from $LLAMA_CPP_BIN_DIR or PATH; with only llama-cpp-python
    installed, its eval() for prefill and batch-1 decode. Absent: one line says how to install it.
    llama.cpp runs the GGUF in its own type (BF16 from make_shape.py), whatever --dtype says.

throughput (the default, as before there were modes): the first --num-prompts requests of
nano-vllm's shared workload (input and output lengths uniform in 100..1024, seed 0), ignore EOS.
twostep gets all requests at once (continuous batching); HF transformers its best static
batching: all prompts in one left-padded batch, generating until the longest output is done (only
the requested tokens count). llama.cpp has no mixed-length driver here; --mode phases compares it.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

QWEN_SHAPE = "/tmp/twostep-qwen-shape"      # make_shape.py's default output
GGUF_NAME = "model-bf16.gguf"
VOCAB = 10000                               # prompt token ids are drawn below this
LLAMA_CPP_BINS = ("llama-bench", "llama-batched-bench")
LLAMA_CPP_HOW = ("build llama-bench and llama-batched-bench from the llama-cpp-python 0.3.36 sdist "
                 "(docs/benchmarking.md) or set LLAMA_CPP_BIN_DIR to their folder")
HF_HOW = "pip install -r requirements-test.txt"


# ---- peers: where they are, and their output ----

def find_llama_cpp(dirs: list[str | None], search_path: bool = True,
                   try_import: bool = True) -> tuple[str, str | None]:
    """("bin", folder) for the first folder holding both benchmark binaries (then PATH),
    else ("python", None) if llama-cpp-python is installed, else ("missing", None)."""
    for d in dirs:
        if d and all(os.access(os.path.join(d, b), os.X_OK) for b in LLAMA_CPP_BINS):
            return "bin", d
    found = [shutil.which(b) for b in LLAMA_CPP_BINS] if search_path else [None]
    if all(found) and len({os.path.dirname(f) for f in found}) == 1:
        return "bin", os.path.dirname(found[0])
    if try_import and importlib.util.find_spec("llama_cpp") is not None:
        return "python", None
    return "missing", None


def default_llama_cpp_dirs() -> list[str | None]:
    return [os.environ.get("LLAMA_CPP_BIN_DIR")]


def parse_llama_bench_json(text: str) -> list[dict]:
    """`llama-bench -o json` -> [{"n_prompt", "n_gen", "n_depth", "tok_s"}] (mean over its reps)."""
    return [{"n_prompt": r["n_prompt"], "n_gen": r["n_gen"], "n_depth": r.get("n_depth", 0),
             "tok_s": r["avg_ts"]} for r in json.loads(text)]


def parse_batched_bench(text: str) -> list[dict]:
    """The markdown table of `llama-batched-bench` -> one dict per row, keyed by its headers
    (PP, TG, B, N_KV, T_PP s, S_PP t/s, T_TG s, S_TG t/s, T s, S t/s), numbers as floats."""
    header, rows = None, []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.lstrip().startswith("|"):
            continue
        if "PP" in cells and "S_TG t/s" in cells:
            header = cells
        elif header and len(cells) == len(header):
            try:
                rows.append(dict(zip(header, map(float, cells))))
            except ValueError:      # the |---|---| rule
                pass
    return rows


# ---- the phases mode ----

@dataclass(frozen=True)
class Phase:
    name: str
    batch: int
    prompt_len: int
    gen: int                      # 1: a prefill phase, measured by the time to first token

    @property
    def is_prefill(self) -> bool:
        return self.gen == 1

    def requests(self, seed: int):
        from twostep.bench.workloads import fixed

        return fixed(self.batch, self.prompt_len, self.gen, VOCAB, seed)


def decode_rate(token_times: list[list[float]]) -> float:
    """Decode tokens/s of a batch from each sequence's token timestamps: the tokens after the
    moment every sequence had its first token, over the time from then to the last token."""
    start = max(t[0] for t in token_times)
    end = max(t[-1] for t in token_times)
    return sum(sum(x > start for x in t) for t in token_times) / (end - start)


class Twostep:
    name = "twostep"

    def __init__(self, path: str, dtype: str, threads: int, kv_cache_memory: str | None = None,
                 int8_activations: str = "decode", huge_pages: bool = True, gemv: bool = True):
        from twostep import LLM

        # the default (decode) is "twostep"; --cpu-int8-activations all / off named after the mode
        self.name = {"decode": "twostep", "all": "twostep int8", "off": "twostep int16"}[int8_activations]
        self.name += ("" if huge_pages else " 4K pages") + ("" if gemv else " no-gemv")
        self.llm = LLM(path, dtype=dtype, enable_prefix_caching=False, num_threads=threads,
                       kv_cache_memory=kv_cache_memory, cpu_int8_activations=int8_activations,
                       cpu_huge_pages=huge_pages, cpu_gemv=gemv)

    def generate(self, reqs):
        from twostep import SamplingParams

        params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in reqs]
        outs = self.llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in reqs], params,
                                 use_tqdm=False)
        assert [len(o.outputs[0].token_ids) for o in outs] == [r.output_len for r in reqs]
        return outs

    def measure(self, phase: Phase, seed: int) -> float:
        outs = self.generate(phase.requests(seed))
        if phase.is_prefill:
            return phase.prompt_len / outs[0].metrics.ttft
        return decode_rate([o.metrics.token_times for o in outs])


class _Stamp:
    """A logits processor that only records when it is called: once per generated token."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores


class HF:
    name = "HF"

    def __init__(self, path: str, dtype: str):
        import torch
        import transformers

        p = Path(path)
        gguf = {"gguf_file": p.name} if p.suffix == ".gguf" else {}
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            p.parent if gguf else p, dtype=getattr(torch, dtype), **gguf).eval()

    def generate(self, ids, mask, new_tokens: int) -> tuple[float, list[float]]:
        """Greedy, exactly new_tokens per row; (start time, one timestamp per generated token)."""
        import torch
        from transformers import LogitsProcessorList

        stamp = _Stamp()
        start = time.perf_counter()
        with torch.inference_mode():
            self.model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens,
                                min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                                logits_processor=LogitsProcessorList([stamp]))
        return start, stamp.times

    def measure(self, phase: Phase, seed: int) -> float:
        import torch

        ids = torch.tensor([r.prompt_token_ids for r in phase.requests(seed)])
        start, times = self.generate(ids, torch.ones_like(ids), phase.gen)
        if phase.is_prefill:
            return phase.prompt_len / (times[0] - start)
        return decode_rate([times] * phase.batch)


class LlamaCppBin:
    name = "llama.cpp"

    # llama.cpp's CPU repack kernels (AMX among them) die by a signal on some CPUs: then the run is
    # repeated with repacking off, as llama.cpp's docs advise, and every later run keeps it off
    NO_REPACK = {"llama-bench": ("--repack", "0"), "llama-batched-bench": ("--no-repack",)}

    def __init__(self, bin_dir: str, gguf: str, threads: int):
        self.bin_dir, self.gguf, self.threads = bin_dir, gguf, threads
        self.repack = True

    def _run(self, binary: str, *args) -> str:
        p, cmd = self._call(binary, args)
        if p.returncode < 0 and self.repack:
            print(f"llama.cpp: {binary} died by signal {-p.returncode}; repacking off from here on "
                  "(--repack 0)", flush=True)
            self.repack = False
            p, cmd = self._call(binary, args)
        if p.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stderr[-2000:]}")
        return p.stdout

    def _call(self, binary: str, args) -> tuple[subprocess.CompletedProcess, list[str]]:
        cmd = [os.path.join(self.bin_dir, binary), "-m", self.gguf, "-t", str(self.threads),
               *(() if self.repack else self.NO_REPACK[binary]), *map(str, args)]
        return subprocess.run(cmd, capture_output=True, text=True), cmd

    def measure(self, phase: Phase, seed: int) -> float:
        if phase.is_prefill:
            out = self._run("llama-bench", "-p", phase.prompt_len, "-n", 0, "-r", 1, "-o", "json")
            return _only(parse_llama_bench_json(out))["tok_s"]
        if phase.batch == 1:
            out = self._run("llama-bench", "-p", 0, "-n", phase.gen, "-d", phase.prompt_len,
                            "-r", 1, "-o", "json")
            return _only(parse_llama_bench_json(out))["tok_s"]
        out = self._run("llama-batched-bench", "-c", phase.batch * (phase.prompt_len + phase.gen),
                        "-npp", phase.prompt_len, "-ntg", phase.gen, "-npl", phase.batch)
        return _only(parse_batched_bench(out))["S_TG t/s"]


class LlamaCppPython:
    """llama-cpp-python's eval(): prefill and batch-1 decode only (its API runs one sequence)."""
    name = "llama.cpp"

    def __init__(self, gguf: str, threads: int, n_ctx: int):
        from llama_cpp import Llama

        self.llm = Llama(gguf, n_ctx=n_ctx, n_batch=512, n_threads=threads,
                         n_threads_batch=threads, verbose=False)

    def measure(self, phase: Phase, seed: int) -> float | None:
        if phase.batch > 1:
            return None
        prompt = phase.requests(seed)[0].prompt_token_ids
        self.llm.reset()
        start = time.perf_counter()
        self.llm.eval(prompt)
        times = [time.perf_counter()]
        if phase.is_prefill:
            return phase.prompt_len / (times[0] - start)
        for _ in range(phase.gen - 1):
            self.llm.eval([prompt[-1]])
            times.append(time.perf_counter())
        return decode_rate([times])


def _only(rows: list[dict]) -> dict:
    if len(rows) != 1:
        raise ValueError(f"expected one result row, got {len(rows)}: {rows}")
    return rows[0]


def llama_cpp_peer(gguf: str, threads: int, n_ctx: int):
    """(engine or None, status line)."""
    kind, where = find_llama_cpp(default_llama_cpp_dirs())
    if kind == "missing":
        return None, f"not installed ({LLAMA_CPP_HOW})"
    if not os.path.isfile(gguf):
        return None, f"{kind} found, but no GGUF at {gguf} (benchmarks/make_shape.py writes it)"
    if kind == "bin":
        return LlamaCppBin(where, gguf, threads), f"{where} (llama-bench, llama-batched-bench)"
    try:
        return (LlamaCppPython(gguf, threads, n_ctx),
                "llama-cpp-python only: decode batch > 1 not measured (" + LLAMA_CPP_HOW + ")")
    except Exception as e:  # noqa: BLE001 - a broken install is reported, not fatal
        return None, f"llama-cpp-python failed to load ({type(e).__name__}: {e})"


def hf_peer(path: str, dtype: str):
    if importlib.util.find_spec("transformers") is None:
        return None, f"not installed ({HF_HOW})"
    import transformers

    return HF(path, dtype), f"transformers {transformers.__version__}"


def run_phases(args) -> dict:
    path = args.model or QWEN_SHAPE
    if not os.path.exists(path):
        sys.exit(f"{path} not found: run .venv/bin/python benchmarks/make_shape.py first")
    gguf = args.gguf or os.path.join(path, GGUF_NAME)
    phases = [Phase(f"prefill {args.prompt_len}", 1, args.prompt_len, 1)] + [
        Phase(f"decode b{b}", b, args.decode_prompt_len, args.gen) for b in args.batches]
    n_ctx = max(p.prompt_len + p.gen for p in phases)
    peers = {}
    hf, peers["HF"] = hf_peer(path, args.dtype) if "HF" in args.peers else (None, "skipped")
    cpp, peers["llama.cpp"] = (llama_cpp_peer(gguf, args.threads, n_ctx) if "llama.cpp" in args.peers
                               else (None, "skipped"))
    for name, status in peers.items():
        print(f"{name}: {status}", flush=True)
    modes = ["decode"] + (["all"] if args.int8_activations else []) + (["off"] if args.int16_activations else [])
    ours = [Twostep(path, args.dtype, args.threads, kv_cache_memory="2GiB", int8_activations=m) for m in modes]
    if args.small_pages:
        ours.append(Twostep(path, args.dtype, args.threads, kv_cache_memory="2GiB", huge_pages=False))
    if args.no_gemv:
        ours.append(Twostep(path, args.dtype, args.threads, kv_cache_memory="2GiB", gemv=False))
    engines = [e for e in (*ours, hf, cpp) if e is not None]
    warm = Phase("warm-up", 1, 16, 4)
    for e in engines:
        e.measure(warm, seed=0)
    samples = {e.name: {p.name: [] for p in phases} for e in engines}
    read = ReadRate() if args.read_rate else None
    shares = {e.name: [] for e in engines}          # batch-1 decode's weight stream / the read rate
    step_bytes = 0
    if read is not None:
        from twostep.layers.dispatch import streamed_weight_bytes

        step_bytes = streamed_weight_bytes(ours[0].llm.engine.model)
    for rep in range(args.reps):
        for p in phases:
            for e in engines:              # back to back: the same minutes for every engine
                around = read is not None and p.batch == 1 and not p.is_prefill
                before = read.measure() if around else None
                tok_s = e.measure(p, seed=rep)
                if tok_s is not None:
                    samples[e.name][p.name].append(tok_s)
                    if around:
                        shares[e.name].append(tok_s * step_bytes / 1e9 / ((before + read.measure()) / 2))
    rows = []
    for p in phases:
        med = {e: statistics.median(s[p.name]) if s[p.name] else None for e, s in samples.items()}
        rows.append({"phase": p.name, **{f"{e}_tok_s": v for e, v in med.items()},
                     **{f"{o.name}/{e}": med[o.name] / v for o in ours for e, v in med.items()
                        if not e.startswith("twostep") and v and med[o.name]}})
    print_table(rows, [e.name for e in engines], [o.name for o in ours])
    stream = {e: statistics.median(x) for e, x in shares.items() if x}
    # the same tokens/s ratio with each engine's memory as fast as the other's: this machine's memory
    # speed moves by 1.5x within seconds, so one engine's runs can fall in a fast spell and the other's in
    # a slow one (a raw ratio of 1.00x beside shares of 72% and 45% of the read)
    normalised = {f"{o.name}/{e}": stream[o.name] / v for o in ours for e, v in stream.items()
                  if not e.startswith("twostep") and o.name in stream and v}
    if stream:
        print(f"\ndecode b1, the weight stream ({step_bytes / 1e6:.0f} MB a token) against a plain read measured "
              "just before and after each run, medians: " + ", ".join(f"{e} {v:.0%}" for e, v in stream.items()))
        if normalised:
            print("decode b1 at the same read rate (the ratio of those shares): "
                  + ", ".join(f"{k} {v:.2f}x" for k, v in normalised.items()))
    return {"mode": "phases", "model": path, "gguf": gguf, "dtype": args.dtype,
            "threads": args.threads, "reps": args.reps, "peers": peers,
            "phases": [vars(p) for p in phases], "rows": rows, "samples": samples,
            **({"b1_stream_of_read": stream, "b1_stream_shares": shares, "step_MB": step_bytes / 1e6,
                "b1_at_same_read_rate": normalised} if stream else {})}


class ReadRate:
    """A plain read (torch's sum) of 512 MB, far more than any last-level cache, in GB/s: what the
    memory delivers in the seconds around a measurement, from memory like twostep's weights (2 MiB
    pages where the OS gives them: faster than 4 KiB pages, so the stricter measure)."""

    def __init__(self, nbytes: int = 512 << 20) -> None:
        import torch

        from twostep.platforms import get_platform

        self.buffer = get_platform(torch.device("cpu")).place_streamed(torch.ones(nbytes // 4))

    def measure(self, reps: int = 3) -> float:
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            self.buffer.sum()
            times.append(time.perf_counter() - start)
        return self.buffer.numel() * 4 / statistics.median(times) / 1e9


def print_table(rows: list[dict], engines: list[str], ours: tuple[str, ...] = ("twostep",)) -> None:
    ratios = [f"{o}/{e}" for o in ours for e in engines if not e.startswith("twostep")]
    columns = ["phase", *engines, *ratios]
    print("\ntokens/s, medians\n| " + " | ".join(columns) + " |\n" + "|---" * len(columns) + "|")
    for r in rows:
        cells = [r["phase"], *(_fmt(r.get(f"{e}_tok_s")) for e in engines),
                 *(f"{r[k]:.2f}" if k in r else "-" for k in ratios)]
        print("| " + " | ".join(cells) + " |")


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:,.0f}" if v >= 100 else f"{v:.1f}"


# ---- the throughput mode ----

def run_throughput(args) -> dict:
    from twostep.bench import workloads
    from twostep.models.loader import resolve_model_path

    path = resolve_model_path(args.model)
    reqs = workloads.nano_vllm(vocab_size=VOCAB, num_prompts=args.num_prompts)
    out_tokens = sum(r.output_len for r in reqs)
    engine = Twostep(path, args.dtype, args.threads)
    start = time.perf_counter()
    engine.generate(reqs)
    ours = out_tokens / (time.perf_counter() - start)
    result = {"mode": "throughput", "workload": f"nano-vllm first {len(reqs)} requests",
              "prompt_tokens": sum(len(r.prompt_token_ids) for r in reqs),
              "output_tokens": out_tokens, "dtype": args.dtype,
              "twostep_output_tok_s": round(ours, 1)}
    hf, result["hf"] = hf_peer(path, args.dtype) if "HF" in args.peers else (None, "skipped")
    if hf is not None:
        hf_tok_s = out_tokens / hf_static_batches(hf, reqs, args.hf_batch_size or len(reqs))
        result.update(hf_static_batch_output_tok_s=round(hf_tok_s, 1),
                      ratio_twostep_over_hf=round(ours / hf_tok_s, 2))
    kind, where = find_llama_cpp(default_llama_cpp_dirs())
    result["llama_cpp"] = (f"not installed ({LLAMA_CPP_HOW})" if kind == "missing" else
                           f"found ({where or 'llama-cpp-python'}); compared in --mode phases only")
    print(json.dumps(result, indent=1))
    return result


def hf_static_batches(hf: HF, reqs, batch_size: int) -> float:
    """Seconds to run reqs through HF in left-padded static batches of batch_size."""
    import torch

    start = time.perf_counter()
    for i in range(0, len(reqs), batch_size):
        batch = reqs[i:i + batch_size]
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, r in enumerate(batch):        # left padding, as generation needs
            ids[j, width - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
            mask[j, width - len(r.prompt_token_ids):] = 1
        hf.generate(ids, mask, max(r.output_len for r in batch))
    return time.perf_counter() - start


def default_dtype() -> str:
    """The dtype twostep's --dtype auto takes on this machine, by name (HF needs a concrete one)."""
    from twostep.platforms import get_platform, resolve_device

    return str(get_platform(resolve_device("cpu")).default_dtype()).removeprefix("torch.")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=["phases", "throughput"], default="throughput")
    ap.add_argument("--model", default=None,
                    help=f"phases: default {QWEN_SHAPE}; throughput: default the packaged model")
    ap.add_argument("--dtype", default="auto",
                    help="auto: what twostep's platform computes fastest here (bfloat16 where the CPU "
                         "has it natively, else float32), for every engine alike")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--peers", nargs="*", default=["HF", "llama.cpp"], choices=["HF", "llama.cpp"])
    ap.add_argument("--json", default=None, metavar="PATH", help="also write the results here")
    g = ap.add_argument_group("phases")
    g.add_argument("--gguf", default=None, help=f"for llama.cpp; default MODEL/{GGUF_NAME}")
    g.add_argument("--reps", type=int, default=5)
    g.add_argument("--prompt-len", type=int, default=512)
    g.add_argument("--decode-prompt-len", type=int, default=128)
    g.add_argument("--gen", type=int, default=128)
    g.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    g.add_argument("--int8-activations", action="store_true",
                   help="also twostep with --cpu-int8-activations all (prompts too at llama.cpp's activation "
                        "precision; the default rounds decode steps only), back to back with the rest")
    g.add_argument("--int16-activations", action="store_true",
                   help="also twostep with --cpu-int8-activations off (16-bit activations everywhere)")
    g.add_argument("--small-pages", action="store_true",
                   help="also twostep with --no-cpu-huge-pages (its weights in 4 KiB pages)")
    g.add_argument("--no-gemv", action="store_true",
                   help="also twostep with --no-cpu-gemv (bf16: oneDNN for 1-3 rows; float32: weights that hold "
                        "bf16 values widened to float32 at load, as before 2026-12-05)")
    g.add_argument("--read-rate", action="store_true",
                   help="measure a plain read before and after each batch-1 decode run and report each "
                        "engine's weight stream as a share of it, and the ratio of the shares: the batch-1 "
                        "ratio the engines would have at the same read rate")
    g = ap.add_argument_group("throughput")
    g.add_argument("--num-prompts", type=int, default=8)
    g.add_argument("--hf-batch-size", type=int, default=None, help="default: all prompts in one batch")
    args = ap.parse_args()
    if args.gen < 2 or args.reps < 1:
        ap.error("--gen must be >= 2 (decode is timed after the first token) and --reps >= 1")
    if args.dtype == "auto":
        args.dtype = default_dtype()
    result = run_phases(args) if args.mode == "phases" else run_throughput(args)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
