"""MTP speculation (the checkpoint's own multi-token-prediction layer) against plain decoding, batch 1.

    .venv/bin/python benchmarks/mtp.py [--model FOLDER] [--tokens 128] [--runs 3] [--ks 1,2]

--model: a Qwen3.5 / Qwen3.5-MoE / Qwen3-Next HF folder with mtp.* weights. Default: a random
Qwen3.5-0.8B-shaped folder (/tmp/twostep-qwen35-mtp-shape), written on first use from
benchmarks/make_shape.py's shape plus random MTP weights in a second shard (mtp.safetensors, with
an index over both files).

For plain decoding and for MTP with each k: an engine each, all loaded at once and run interleaved
run by run (bfloat16 where the CPU has it, prefix caching off), a 16-token prompt, greedy, `--tokens`
new tokens (EOS ignored), `--runs` runs;
reported: decode tokens/s ((tokens - 1) / (last step's end - first token's), the median of the
runs), the acceptance rate (accepted / drafted tokens) and the median time of one step of each kind:

  t_decode   the target's forward of a plain decode step (1 row), in the plain engine;
  t_verify   the target's forward of a verification step (k + 1 rows), in the MTP engine;
  t_draft    the MTP layer's work per step: its rows of the verified tokens, k - 1 draft rows, k
             lm_heads (and sampling), the proposer's observe + propose.

The self-draft upper bound is what MTP would give if every draft were accepted: each step then
emits k + 1 tokens for the price of one verification and its drafting, where plain decoding pays
k + 1 decode steps:

  upper bound = (k + 1) * t_decode / (t_verify + t_draft)       (scheduling overhead aside)

and "verify only" leaves t_draft out (the ceiling for a free draft). With random weights almost
no draft is accepted, so the measured speed shows the cost of speculating for nothing and the bound
what a trained MTP layer could reach on this machine (Qwen3.5's reports ~80-90 % acceptance for
k = 1). Prints a markdown table.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

DEFAULT = Path("/tmp/twostep-qwen35-mtp-shape")
PROMPT = [(37 * i + 11) % 50000 + 1000 for i in range(16)]


def write_default_model(folder: Path, seed: int = 0) -> None:
    """The Qwen3.5-0.8B shape (make_shape.py) and random mtp.* tensors beside it, if not there yet."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import make_shape

    if not (folder / "model.safetensors").is_file():
        folder.mkdir(parents=True, exist_ok=True)
        make_shape.write_hf_folder(folder, "qwen3.5-0.8b", seed)
    if not (folder / "mtp.safetensors").is_file():
        add_random_mtp(folder, seed)


def add_random_mtp(folder: Path, seed: int) -> None:
    """mtp.fc [H, 2H], the three norms, and a full-attention layer shaped as the model's first one,
    in bfloat16 (std 0.02, HF's initializer range), in mtp.safetensors with an index over both files."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    config = json.loads((folder / "config.json").read_text())
    config = config.get("text_config", config)
    full = config["layer_types"].index("full_attention")
    with safe_open(folder / "model.safetensors", "pt") as f:
        names = list(f.keys())
        shapes = {n: f.get_slice(n).get_shape() for n in names}
    h = shapes["model.norm.weight"][0]
    layer = f"model.layers.{full}."
    want = {"mtp.fc.weight": [h, 2 * h], "mtp.pre_fc_norm_embedding.weight": [h],
            "mtp.pre_fc_norm_hidden.weight": [h], "mtp.norm.weight": [h]}
    want |= {"mtp.layers.0." + n.removeprefix(layer): s for n, s in shapes.items() if n.startswith(layer)}
    g = torch.Generator().manual_seed(seed)
    tensors = {n: (torch.randn(s, generator=g) * (0.02 if len(s) > 1 else 0.0)).to(torch.bfloat16)
               for n, s in want.items()}
    save_file(tensors, folder / "mtp.safetensors", metadata={"format": "pt"})
    weight_map = {n: "model.safetensors" for n in names} | {n: "mtp.safetensors" for n in tensors}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


class Timer:
    """Wall time of each call of a method, appended to a list."""

    def __init__(self, obj, name: str) -> None:
        self.times: list[float] = []
        inner = getattr(obj, name)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.times.append(time.perf_counter() - t0)
        setattr(obj, name, timed)


def run(engine, tokens: int) -> tuple[float, list[float], list[float]]:
    """One request: decode tokens/s, and the runner's and the proposer's time per decode step."""
    from twostep import SamplingParams

    runner = Timer(engine.runner, "execute")
    drafting = []
    if engine.proposer is not None:
        observe, propose = Timer(engine.proposer, "observe"), Timer(engine.proposer, "propose")
    engine.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
    engine.step()                                    # the prompt and the first token
    steps_before = len(runner.times)
    t0, emitted = time.perf_counter(), 1
    while engine.has_unfinished_requests():
        for out in engine.step():
            emitted = len(out.outputs[0].token_ids)
    elapsed = time.perf_counter() - t0
    verify = runner.times[steps_before:]
    if engine.proposer is not None:
        drafting = [a + b for a, b in zip(observe.times[1:], propose.times[1:])]
        del engine.proposer.observe, engine.proposer.propose       # the class's methods again
    del engine.runner.execute
    return (emitted - 1) / elapsed, verify, drafting


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help=f"an HF folder with mtp.* weights (default: {DEFAULT}, made)")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--ks", default="1,2", help="MTP drafts per step to measure")
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    folder = Path(args.model) if args.model else DEFAULT
    if args.model is None:
        write_default_model(folder)

    from twostep.engine.llm_engine import LLMEngine

    ks = [0] + [int(k) for k in args.ks.split(",")]
    engines = {}
    for k in ks:
        spec = {"method": "mtp", "num_speculative_tokens": k} if k else None
        engines[k] = LLMEngine.from_args(model=str(folder), dtype=args.dtype, enable_prefix_caching=False,
                                         kv_cache_memory="512MiB", speculative_config=spec)
        run(engines[k], 8)                           # warm-up: kernels, first touch of the weights
    before = {k: e.get_stats() for k, e in engines.items()}
    speeds = {k: [] for k in ks}
    steps = {k: [] for k in ks}
    drafts = {k: [] for k in ks}
    for _ in range(args.runs):                       # interleaved: this machine's speed drifts
        for k, engine in engines.items():
            speed, step, draft = run(engine, args.tokens)
            speeds[k].append(speed)
            steps[k] += step
            drafts[k] += draft
    t_decode = statistics.median(steps[0])
    rows = [("plain", statistics.median(speeds[0]), "", t_decode, "", "", "")]
    for k in ks[1:]:
        stats = engines[k].get_stats()
        drafted = stats["spec_decode_num_draft_tokens"] - before[k]["spec_decode_num_draft_tokens"]
        accepted = stats["spec_decode_num_accepted_tokens"] - before[k]["spec_decode_num_accepted_tokens"]
        t_step, t_draft = statistics.median(steps[k]), statistics.median(drafts[k])
        rows.append((f"mtp k={k}", statistics.median(speeds[k]), f"{accepted / max(drafted, 1):.1%}", t_step, t_draft,
                     f"{(k + 1) * t_decode / t_step:.2f}x", f"{(k + 1) * t_decode / (t_step + t_draft):.2f}x"))
    print(f"\n{folder}: batch 1, greedy, {args.tokens} tokens, median of {args.runs} runs\n")
    print("| | decode tok/s | acceptance | target step ms | MTP drafting ms | upper bound, verify only | "
          "upper bound (all drafts accepted) |")
    print("|---|---|---|---|---|---|---|")
    for name, speed, acc, step, draft, verify_only, bound in rows:
        draft = f"{draft * 1e3:.1f}" if draft != "" else ""
        print(f"| {name} | {speed:.1f} | {acc} | {step * 1e3:.1f} | {draft} | {verify_only} | {bound} |")


if __name__ == "__main__":
    main()
