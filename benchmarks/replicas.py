"""Replicas behind one endpoint, prefix-aware against round-robin routing: TTFT, output throughput and
the prefix-cache hit rate of multi-turn chats under one shared system prompt.

    .venv/bin/python benchmarks/replicas.py                    # 2 reps, the default model
    .venv/bin/python benchmarks/replicas.py --reps 1 --conversations 4

Setups, each on this machine's cores: one engine (`twostep serve --num-threads 2`); one replica on Ray
(the front's cost: --min/--max-replicas 1, 2 CPUs); two replicas (-dp 2, a CPU and a thread each) with
--routing-policy prefix_aware, then round_robin. The same seeded `twostep bench serve --dataset
shared-prefix` workload goes to each (a conversation's next turn is sent when its last one finished);
medians over reps. On one machine the replicas share its cores, so two replicas cannot beat one engine
here: what the routing changes is the hit rate and with it the prefill work; the per-replica figures
project the case of a replica per machine.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from disagg import TWOSTEP, Processes     # the same servers' start, health wait and stop

KEYS = ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "output_throughput", "prefix_cache_hit_rate",
        "duration", "failed")
SETUPS = {
    "1 engine": ["--num-threads", "2"],
    "1 replica (Ray)": ["--min-replicas", "1", "--max-replicas", "1", "--replica-cpus", "2"],
    "2 replicas, prefix_aware": ["-dp", "2", "--replica-cpus", "1", "--routing-policy", "prefix_aware"],
    "2 replicas, round_robin": ["-dp", "2", "--replica-cpus", "1", "--routing-policy", "round_robin"],
}
for _n in (2, 8):     # --routing-imbalance other than its default (4)
    SETUPS[f"2 replicas, imbalance {_n}"] = ["-dp", "2", "--replica-cpus", "1", "--routing-imbalance", str(_n)]


def bench(base: str, args, out: Path, seed: int) -> dict:
    cmd = [*TWOSTEP, "bench", "serve", "--base-url", base, "--dataset", "shared-prefix", "--workload-seed", str(seed),
           "--conversations", str(args.conversations), "--turns", str(args.turns),
           "--input-len", str(args.system_len), "--turn-len", str(args.turn_len),
           "--output-len", str(args.output_len), "--save-json", str(out)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def run_setup(name: str, args, work: Path) -> dict:
    model = ["--model", args.model] if args.model else []
    with Processes(work) as procs:
        base = procs.start(name.replace(" ", "_"), ["serve", *model, "--max-model-len", str(args.max_model_len),
                                                    *SETUPS[name]])
        bench(base, args, work / "warm.json", seed=1)   # warm-up (kernels, allocations) on other prompts
        return bench(base, args, work / f"{time.monotonic_ns()}.json", seed=0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the packaged SmolLM2-135M-Instruct GGUF")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--system-len", type=int, default=512)
    ap.add_argument("--turn-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--setups", nargs="+", default=list(SETUPS)[:4], choices=list(SETUPS))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    results: dict[str, list[dict]] = {name: [] for name in args.setups}
    with tempfile.TemporaryDirectory(prefix="twostep-replicas-") as tmp:
        for rep in range(args.reps):
            order = args.setups if rep % 2 == 0 else args.setups[::-1]
            for name in order:
                r = run_setup(name, args, Path(tmp))
                results[name].append(r)
                print(f"rep {rep + 1}/{args.reps} {name}: " + ", ".join(f"{k} {r[k]:.3g}" for k in KEYS),
                      file=sys.stderr)
    medians = {name: {k: statistics.median(r[k] for r in runs) for k in KEYS} for name, runs in results.items()}
    if args.json:
        print(json.dumps({"args": vars(args), "medians": medians, "runs": results}, indent=2))
        return
    print(f"{'setup':<26} {'TTFT p50 ms':>11} {'TTFT p99 ms':>11} {'TPOT p50 ms':>11} {'out tok/s':>9} "
          f"{'cache hits':>10}")
    for name, m in medians.items():
        print(f"{name:<26} {m['median_ttft_ms']:>11.1f} {m['p99_ttft_ms']:>11.1f} {m['median_tpot_ms']:>11.1f} "
              f"{m['output_throughput']:>9.1f} {m['prefix_cache_hit_rate']:>10.1%}")


if __name__ == "__main__":
    main()
